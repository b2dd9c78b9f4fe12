"""The transport between nodes' memory tiers: a read-only file server per node, and the
client that reads another node's folder through it (tiers/node_memory.py falls back to it).
This package's modules, one job each: `address` (which address a node serves on),
`wire` (the HTTP/1.1 heads, parsed with h11, and their MACs), `server` (PeerServer) and
`client` (PeerBackend, the read-only peer store); the names below are re-exported here.

A memory checkpoint of a job on several nodes lives in several node folders: each node holds
the files its own ranks wrote and, with `tiers.memory.replicate`, a copy of its previous
node's files (docs/tiers.md). A rank that loads, or rank 0 that drains to storage.url, may
need a file of another node; that node's leader serves its folder over HTTP/1.1 (GET with
one byte range, HEAD, bodies sent with `sendfile`), and `NodeMemoryBackend` falls back to
it, through `PeerBackend`, for whatever this node lacks. Every byte read that way is checked
against the manifest like any other read, so a peer can fail a load but never slip a wrong
byte into it. Why a socket and not the job's process group: docs/tiers.md#the-peer-transport.

The server is built to cost its training process bounded resources whoever reaches its port
(docs/tiers.md#the-peer-transport states the properties exactly):

- it listens on one address only: $STATEREG_PEER_HOST, else the address of the interface
  gloo uses ($GLOO_SOCKET_IFNAME), else the one this host routes to $MASTER_ADDR by, else
  the host name's (`peer_host`);
- one thread reads every request head (a selector, no thread per connection): a new
  connection has `head_deadline` seconds to send a whole head of at most 8 KiB (closed
  unanswered past either); at most `max_pending` wait so (the oldest is closed for a new
  one), and no thread or file is opened for them. A head that h11 does not parse as an
  HTTP/1.1 GET or HEAD (no Host, a repeated Range or Authorization, ...) is a bare 400;
- every request carries an HMAC-SHA256, under the job's secret, of its method, the server's
  address, the path, the range, a timestamp and a nonce (`Authorization: statereg-hmac`);
  the secret never crosses the network. A wrong MAC, a timestamp outside `window` seconds
  or a nonce already seen closes the connection with a bare 403, from the selector thread;
- only authenticated requests reach the `workers` threads that open files and send them,
  and at most `max_connections` authenticated connections are open (a 503 beyond);
  between requests a kept-alive connection waits in the selector, holding no thread;
- every answer to an authenticated request carries an HMAC of the request's nonce and the
  answer's status and lengths, so the client knows it reached the job's server.

The client requires exactly the status and `Content-Range` it asked for and never more
bytes than it asked for, and each request has one deadline for the whole exchange (head and
body): `timeout` seconds plus one second per `_MIN_RATE` bytes received, so a peer that
lies or trickles costs bounded time and is a StorageError naming it.
"""

from statereg.tiers.transport.address import (
    GLOO_IFNAME_ENV,
    PEER_HOST_ENV,
    interface_address,
    network_namespace,
    peer_address,
    peer_host,
    unusable_across_machines,
)
from statereg.tiers.transport.client import PEER_TIMEOUT_ENV, PeerBackend, open_peer
from statereg.tiers.transport.server import PeerServer
from statereg.tiers.transport.wire import answer_mac as _answer_mac
from statereg.tiers.transport.wire import request_mac as _request_mac

__all__ = [
    "GLOO_IFNAME_ENV",
    "PEER_HOST_ENV",
    "PEER_TIMEOUT_ENV",
    "PeerBackend",
    "PeerServer",
    "_answer_mac",
    "_request_mac",
    "interface_address",
    "network_namespace",
    "open_peer",
    "peer_address",
    "peer_host",
    "unusable_across_machines",
]
