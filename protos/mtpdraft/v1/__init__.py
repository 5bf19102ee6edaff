"""Generated code for the mtpdraft.v1 wire contract (`make proto`; never edit)."""
