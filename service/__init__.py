"""The drafter server: the gRPC servicer, the server and the `mtpdraft` command.

`serving` drives the engine from the event loop (its thread, the scheduler, leases),
`engine` holds the states and the propose / verify cycle (no gRPC, no asyncio), `model`
the checkpoint loading and the MTP forward (no states).
"""
