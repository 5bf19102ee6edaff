"""The MTP head: checkpoint loading, the paged KV storage and the forward; no states."""
