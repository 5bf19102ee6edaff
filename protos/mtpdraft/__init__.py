"""mtpdraft: a gRPC service that serves speculative-decoding drafts from an MTP head.

`mtpdraft.v1` holds the wire contract's generated code, `mtpdraft.service` the
server, engine and model, `mtpdraft.kernels` the Triton kernels and
`mtpdraft.client` the Python client.
"""

__version__ = "0.1.0"
