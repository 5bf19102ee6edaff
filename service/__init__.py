"""The drafter server: the gRPC servicer, the server and the `mtpdraft` command.

`engine` holds the states and the propose / verify cycle (no gRPC), `model` the
checkpoint loading and the MTP forward (no states).
"""
