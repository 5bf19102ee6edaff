"""The drafter engine: states, KV blocks, leases and the propose / verify cycle; no gRPC,
no asyncio, no threads."""
