"""statereg.load_spec: a mistyped statereg.yaml is a SpecError naming file, field and choices."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import statereg

VALID = """\
version: 1
storage:
  url: ./checkpoints
components:
  model: {kind: model}
  optimizer: {kind: optimizer}
  scheduler: {kind: scheduler}
  dataloader: {kind: dataloader}
  rng: {kind: rng}
save:
  keep_last: 3
profiles:
  finetune: {exclude: [optimizer, scheduler, dataloader]}
"""


@pytest.fixture
def write_yaml(tmp_path):
    """Write YAML text to tmp_path/statereg.yaml and return the path."""

    def write(text: str):
        path = tmp_path / "statereg.yaml"
        path.write_text(textwrap.dedent(text))
        return path

    return write


def spec_error(path, **kwargs) -> str:
    with pytest.raises(statereg.SpecError) as info:
        statereg.load_spec(path, environ={}, **kwargs)
    return str(info.value)


# -- a valid declaration ----------------------------------------------------------------


def test_valid_yaml_loads_into_a_registry_spec(write_yaml):
    spec = statereg.load_spec(write_yaml(VALID), environ={})

    assert isinstance(spec, statereg.RegistrySpec)
    assert spec.storage.url == "./checkpoints"
    assert list(spec.components) == ["model", "optimizer", "scheduler", "dataloader", "rng"]
    assert spec.save.keep_last == 3
    assert spec.profiles["finetune"].exclude == ["optimizer", "scheduler", "dataloader"]


def test_path_may_be_a_str_or_a_pathlike(write_yaml):
    path = write_yaml(VALID)
    assert statereg.load_spec(str(path), environ={}) == statereg.load_spec(path, environ={})


@pytest.mark.parametrize(
    ("kind", "sharing", "fmt"),
    [
        ("model", "sharded", "dcp"),
        ("optimizer", "sharded", "dcp"),
        ("scheduler", "global", "json"),
        ("dataloader", "per_rank", "json"),
        ("rng", "per_rank", "json"),
        ("custom", "global", "json"),
    ],
)
def test_sharing_and_format_default_by_kind(kind, sharing, fmt):
    components = {"model": {"kind": "model"}, "thing": {"kind": kind}}
    spec = statereg.load_spec({"storage": {"url": "x"}, "components": components}, environ={})

    comp = spec.components["thing"]
    assert comp.sharing is None and comp.format is None
    assert comp.resolved_sharing == sharing
    assert comp.resolved_format == fmt


def test_declared_sharing_and_format_win_over_the_defaults(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, sharing: replicated}
          stats: {kind: custom, format: dcp}
        """)
    spec = statereg.load_spec(path, environ={})

    assert spec.components["model"].resolved_sharing == "replicated"
    assert spec.components["stats"].resolved_format == "dcp"


def test_async_off_written_unquoted_in_yaml_is_accepted(write_yaml):
    # YAML 1.1 reads a bare `off` as the boolean false; the documented value must still work.
    path = write_yaml("""\
        storage: {url: x}
        components: {model: {kind: model}}
        save: {async: off}
        """)
    assert statereg.load_spec(path, environ={}).save.async_mode == "off"


def test_async_thread_is_accepted(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components: {model: {kind: model}}
        save: {async: thread}
        """)
    assert statereg.load_spec(path, environ={}).save.async_mode == "thread"


# -- mistakes: each names the file, the field path and what is allowed -------------------


def test_unknown_component_field_names_the_path_and_the_allowed_fields(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model}
          optimizer: {kind: optimizer, sharding: sharded}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "components.optimizer.sharding" in message
    assert "unknown field 'sharding'" in message
    for allowed in ("kind", "sharing", "format", "prefix", "required", "model", "group"):
        assert allowed in message


def test_unknown_top_level_field_lists_the_sections(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        component: {model: {kind: model}}
        """)
    message = spec_error(path)

    assert message == (
        f"{path}: component: unknown field 'component'; "
        "allowed fields: components, on_signal, profiles, restore, save, storage, tiers, version"
    )


def test_misspelled_sharing_pattern_lists_the_allowed_patterns(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, sharing: shraded}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "components.model.sharing" in message
    assert "'shraded'" in message
    for allowed in ("global", "replicated", "per_rank", "per_group", "'sharded'"):
        assert allowed in message


def test_misspelled_kind_lists_the_kinds(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: modle}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "components.model.kind" in message
    assert "'modle'" in message
    for allowed in ("model", "optimizer", "scheduler", "dataloader", "rng", "custom"):
        assert f"'{allowed}'" in message


def test_duplicate_component_key_is_rejected_with_both_lines(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model}
          optimizer: {kind: optimizer}
          model: {kind: model, sharing: replicated}
        """)
    message = spec_error(path)

    assert message.startswith(f"{path}:5:")
    assert "duplicate key 'model'" in message
    assert "line 3" in message


def test_prefix_of_the_wrong_type_names_the_field(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, prefix: "model."}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "components.model.prefix" in message
    assert "'model.'" in message
    assert "dictionary" in message or "mapping" in message


def test_prefix_needs_drop_or_add(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, prefix: {}}
        """)
    message = spec_error(path)

    assert "components.model.prefix" in message
    assert "'drop'" in message and "'add'" in message


def test_missing_storage_url(write_yaml):
    path = write_yaml("""\
        storage: {options: {}}
        components: {model: {kind: model}}
        """)
    message = spec_error(path)

    assert f"{path}: storage.url: required field is missing" in message


def test_missing_storage_section(write_yaml):
    path = write_yaml("components: {model: {kind: model}}\n")
    assert f"{path}: storage: required field is missing" in spec_error(path)


@pytest.mark.parametrize("url", ['""', '"   "'])
def test_blank_storage_url(write_yaml, url):
    path = write_yaml(f"""\
        storage: {{url: {url}}}
        components: {{model: {{kind: model}}}}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "storage.url" in message


def test_whitespace_only_url_is_called_blank(write_yaml):
    path = write_yaml("""\
        storage: {url: "   "}
        components: {model: {kind: model}}
        """)
    message = spec_error(path)

    assert "storage url is blank" in message
    assert "s3://" in message


def test_bad_yaml_syntax_points_at_line_and_column(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model
        save: {}
        """)
    message = spec_error(path)

    assert message.startswith(f"{path}:4:")
    assert "invalid YAML" in message


def test_missing_file_is_a_spec_error_naming_it(tmp_path):
    path = tmp_path / "nope.yaml"
    message = spec_error(path)

    assert str(path) in message
    assert "file not found" in message


def test_a_declaration_that_is_not_a_mapping(write_yaml):
    path = write_yaml("- storage\n- components\n")
    message = spec_error(path)

    assert str(path) in message
    assert "'storage' and 'components'" in message


def test_optimizer_without_a_model_component(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          optimizer: {kind: optimizer}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "components.optimizer needs 'model'" in message
    assert "model components: none" in message


def test_optimizer_must_name_its_model_when_there_are_two(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          student: {kind: model}
          teacher: {kind: model}
          optimizer: {kind: optimizer}
        """)
    message = spec_error(path)

    assert "components.optimizer needs 'model'" in message
    assert "student" in message and "teacher" in message


def test_optimizer_naming_an_unknown_model(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model}
          optimizer: {kind: optimizer, model: modle}
        """)
    message = spec_error(path)

    assert "components.optimizer.model names 'modle'" in message
    assert "['model']" in message


def test_profile_naming_an_unknown_component(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model}
          optimizer: {kind: optimizer}
        profiles:
          finetune: {exclude: [optimiser]}
        """)
    message = spec_error(path)

    assert str(path) in message
    assert "profiles.finetune names unknown component 'optimiser'" in message
    assert "components: model, optimizer" in message


def test_component_name_must_be_portable(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          "../model": {kind: model}
        """)
    message = spec_error(path)

    assert "'../model'" in message
    assert "directory name" in message


@pytest.mark.parametrize("name", ["model\n", "model\r\n", "\nmodel"])
def test_component_name_with_a_newline_is_refused(name):
    """`$` matches before a trailing newline; the check must not let "model\\n" through."""
    with pytest.raises(statereg.SpecError) as info:
        statereg.load_spec({"storage": {"url": "x"}, "components": {name: {"kind": "model"}}})
    assert repr(name) in str(info.value)
    assert "directory name" in str(info.value)


def test_a_tab_in_the_indentation_says_use_spaces(tmp_path):
    path = tmp_path / "statereg.yaml"
    path.write_text("storage:\n\turl: x\ncomponents: {model: {kind: model}}\n")
    message = spec_error(path)

    assert message.startswith(f"{path}:2:1: invalid YAML")
    assert "YAML indents with spaces, never tabs" in message


@pytest.mark.parametrize("word", ["on", "yes", "true", "True"])
def test_async_on_says_on_is_yaml_for_true(write_yaml, word):
    path = write_yaml(f"""\
        storage: {{url: x}}
        components: {{model: {{kind: model}}}}
        save: {{async: {word}}}
        """)
    message = spec_error(path)

    assert "save.async: `on` (like yes and true) is YAML for true" in message
    assert "write thread" in message


def test_json_format_cannot_hold_model_tensors(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, format: json}
        """)
    message = spec_error(path)

    assert "components.model" in message
    assert "format 'json' cannot hold model tensors" in message


def test_per_group_sharing_needs_a_group(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, sharing: per_group}
        """)
    assert "needs 'group'" in spec_error(path)


def test_every_problem_is_reported_on_its_own_line(write_yaml):
    path = write_yaml("""\
        storage: {url: x}
        components:
          model: {kind: model, sharing: shraded}
          sched: {kind: schedular}
        """)
    lines = spec_error(path).splitlines()

    assert any("components.model.sharing" in line for line in lines)
    assert any("components.sched.kind" in line for line in lines)
    assert all(line.startswith(f"{path}: ") for line in lines)


# -- overrides and the environment --------------------------------------------------------


def test_environment_overrides_the_storage_url(write_yaml):
    path = write_yaml(VALID)
    spec = statereg.load_spec(path, environ={"STATEREG_STORAGE__URL": "s3://bkt/run1"})

    assert spec.storage.url == "s3://bkt/run1"


def test_environment_values_parse_as_yaml(write_yaml):
    path = write_yaml(VALID)
    spec = statereg.load_spec(path, environ={"STATEREG_SAVE__KEEP_LAST": "7"})

    assert spec.save.keep_last == 7


def test_unrelated_environment_variables_are_ignored(write_yaml):
    path = write_yaml(VALID)
    environ = {"STATEREG_NOT_A_SECTION": "1", "STORAGE__URL": "s3://other", "HOME": "/root"}

    assert statereg.load_spec(path, environ=environ).storage.url == "./checkpoints"


def test_overrides_beat_the_environment_which_beats_the_file(write_yaml):
    path = write_yaml(VALID)
    environ = {"STATEREG_STORAGE__URL": "s3://from-env/run"}

    assert statereg.load_spec(path, environ={}).storage.url == "./checkpoints"
    assert statereg.load_spec(path, environ=environ).storage.url == "s3://from-env/run"
    overridden = statereg.load_spec(
        path, overrides={"storage.url": "gs://from-override/run"}, environ=environ
    )
    assert overridden.storage.url == "gs://from-override/run"


def test_override_can_add_a_nested_section(write_yaml):
    path = write_yaml(VALID)
    spec = statereg.load_spec(path, overrides={"save.keep_best.metric": "loss"}, environ={})

    assert spec.save.keep_best is not None
    assert spec.save.keep_best.metric == "loss"
    assert spec.save.keep_last == 3


def test_an_invalid_override_is_reported_against_its_field(write_yaml):
    path = write_yaml(VALID)
    message = spec_error(path, overrides={"components.model.sharing": "everywhere"})

    assert "components.model.sharing" in message
    assert "'everywhere'" in message


def test_override_through_a_scalar_is_a_spec_error(write_yaml):
    path = write_yaml(VALID)
    message = spec_error(path, overrides={"storage.url.scheme": "s3"})

    assert "override storage.url.scheme" in message
    assert "'url' is not a mapping" in message


def test_a_dict_source_is_not_modified(write_yaml):
    data = {"storage": {"url": "x"}, "components": {"model": {"kind": "model"}}}
    statereg.load_spec(data, overrides={"storage.url": "y"}, environ={})

    assert data["storage"]["url"] == "x"


def test_a_registry_spec_source_round_trips_with_overrides(write_yaml):
    spec = statereg.load_spec(write_yaml(VALID), environ={})
    again = statereg.load_spec(spec, overrides={"storage.url": "memory://run"}, environ={})

    assert again.storage.url == "memory://run"
    assert again.components == spec.components
    assert again.profiles == spec.profiles


def test_declarations_are_frozen(write_yaml):
    spec = statereg.load_spec(write_yaml(VALID), environ={})
    with pytest.raises(ValueError, match="frozen"):
        spec.storage.url = "elsewhere"  # type: ignore[misc]


# -- torch-free ---------------------------------------------------------------------------


def test_schemas_and_load_spec_import_without_torch(write_yaml):
    path = write_yaml(VALID)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import statereg.schemas
        import statereg
        spec = statereg.load_spec({str(path)!r}, environ={{}})
        assert isinstance(spec, statereg.schemas.RegistrySpec)
        assert isinstance(spec, statereg.RegistrySpec)
        try:
            statereg.load_spec({{"storage": {{"url": ""}}, "components": {{}}}}, environ={{}})
        except statereg.SpecError:
            pass
        else:
            raise AssertionError("a blank url was accepted")
        print("ok", spec.storage.url)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok ./checkpoints"
