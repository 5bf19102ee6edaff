"""`mtpdraft serve`'s options: one frozen dataclass, each option's default and help written
once, here.

The command's parser is generated from `ServeConfig` and fills it (cli.py). The config
is handed down whole: the engine (`DraftEngine`), the serving loop and its scheduler
(`serving/`) and the gRPC server each read their own fields of it, and none repeats
a default. A field's metadata holds its flag's help (and `choices`, `metavar`, `group`,
and `shown_default` for a default better named than printed, where it has them); a bool
field that defaults to True is the flag `--no-NAME`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .model.default_model import DEFAULT_CHECKPOINT

# Without --kv-blocks, the share of the free GPU memory the KV pool takes.
KV_MEMORY_FRACTION = 0.25


def _option(default: Any, help: str, **flag: Any) -> Any:
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ServeConfig:
    # --- the model and where it runs
    model: str = _option(
        str(DEFAULT_CHECKPOINT),
        "checkpoint folder: config.json and safetensors (a full target checkpoint works)",
        metavar="DIR",
        shown_default="the embedded default model",
    )
    device: str = _option("auto", "auto: cuda where there is one", choices=("auto", "cpu", "cuda"))
    dtype: str | None = _option(
        None,
        "compute dtype",
        choices=("bfloat16", "float16", "float32"),
        shown_default="the checkpoint's",
    )
    ops: str = _option(
        "auto",
        "forward ops (auto: Triton kernels on CUDA, torch elsewhere)",
        choices=("auto", "torch", "triton"),
    )
    cuda_graphs: bool = _option(
        True, "run the draft step eagerly, without CUDA graphs", shown_default="graphs on CUDA"
    )

    # --- the engine's limits
    max_states: int = _option(1024, "live states, at most")
    max_states_per_client: int | None = _option(
        None, "live states one client host may hold", shown_default="no limit"
    )
    max_rows_per_state: int | None = _option(
        None, "rows (prompt + drafts) one state may hold", shown_default="no limit"
    )
    kv_blocks: int | None = _option(
        None,
        "KV pool size in blocks",
        shown_default="--kv-memory-fraction of the free GPU memory, or 256 MiB of host memory",
    )
    kv_memory_fraction: float | None = _option(
        None,
        "without --kv-blocks: the fraction of the free GPU memory (once the weights are "
        "loaded) given to the KV pool, 0 < F <= 1",
        metavar="F",
        shown_default=KV_MEMORY_FRACTION,
    )
    block_size: int = _option(16, "rows per KV block")
    state_ttl: float = _option(
        600.0, "idle seconds before a state or an untaken KV handle is freed", metavar="SECONDS"
    )
    max_drafts: int = _option(16, "largest K")
    max_batch: int = _option(64, "largest ProposeBatch, and the most requests in one forward")
    max_sample_top_k: int = _option(
        64, "the most tokens a sampled draft's q holds (its support, sent with each draft)"
    )

    # --- grammars (xgrammar: pip install 'mtpdraft[grammar]')
    tokenizer: str | None = _option(
        None,
        "the tokenizer.json (or its folder) grammars read the vocabulary's bytes from",
        metavar="PATH",
        shown_default="the checkpoint folder's",
    )
    grammar_compile_timeout: float = _option(
        10.0,
        "seconds a grammar may take to compile (past it: DEADLINE_EXCEEDED; the compilation "
        "goes on into the cache)",
        metavar="SECONDS",
    )
    grammar_cache_size: int = _option(256, "compiled grammars kept for states to share")

    # --- scheduling
    max_queue: int = _option(4096, "Propose calls waiting, at most (past it: RESOURCE_EXHAUSTED)")
    # About one batch-1 step of MiMo-7B's MTP head on an H200 (2.2 ms): waiting less than
    # a step for a verifier about to return costs the queued ones less than making it wait
    # a whole step. With it, 8 closed-loop streams ran as batches of 8 instead of
    # alternating 1 and 7: 4392 -> 5860 drafts/s (H200, MiMo-7B shape, K=4).
    batch_wait_us: float = _option(
        2000.0,
        "the most a batch waits for verifiers due back (0: start at once)",
        metavar="US",
    )

    # --- the gRPC server
    host: str = _option("127.0.0.1", "address to serve on")
    port: int = _option(50051, "port to serve on; 0 picks a free one (printed)", metavar="PORT")
    unix_socket: str | None = _option(
        None,
        "also serve on this Unix domain socket (verifiers on the same host: a shorter round "
        "trip than TCP loopback)",
        metavar="PATH",
        shown_default="none",
    )
    # 16 MiB: room for a ProposeBatch of 64 states with bf16 hiddens of 4096 and a bitmask
    # row each (64 x (8 KB + 19 KB) = 1.7 MB) and for Prefill chunks of a few MB, while
    # one message can never take a large share of memory.
    max_message_bytes: int = _option(16 << 20, "largest message, either way", metavar="B")
    max_inflight: int | None = _option(
        None, "concurrent RPCs; streams count as one", shown_default="no limit"
    )
    reflection: bool = _option(True, "turn server reflection off", shown_default="served")
    grace_period: float = _option(
        10.0, "seconds live states may go on after SIGTERM", metavar="SECONDS"
    )
    engine_stall_timeout: float = _option(
        30.0,
        "health answers NOT_SERVING while a call has waited this long for the engine thread "
        "(a stuck engine: liveness probes restart it; 0: never)",
        metavar="SECONDS",
    )
    metrics_port: int | None = _option(
        None,
        "serve the metrics for Prometheus at http://HOST:PORT/metrics (0 picks a free port, "
        "printed)",
        metavar="PORT",
        shown_default="off",
    )
    log_level: str = _option(
        "info", "the service's log level", choices=("debug", "info", "warning", "error")
    )

    # --- security
    tls_cert: str | None = _option(
        None,
        "serve TLS: the server's PEM certificate",
        metavar="FILE",
        group="security",
        shown_default="plaintext",
    )
    tls_key: str | None = _option(
        None,
        "the PEM private key of --tls-cert",
        metavar="FILE",
        group="security",
        shown_default="none",
    )
    tls_client_ca: str | None = _option(
        None,
        "mutual TLS: require client certificates signed by this PEM CA",
        metavar="FILE",
        group="security",
        shown_default="no client certificates",
    )
    auth_token_file: str | None = _option(
        None,
        "require 'authorization: Bearer <token>' on every call but health; one token per "
        "line (several while rotating), re-read every second; an emptied or deleted file "
        "accepts no token",
        metavar="FILE",
        group="security",
        shown_default="no authentication",
    )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def kv_fraction(self) -> float:
        """--kv-memory-fraction, or its default where not given."""
        given = self.kv_memory_fraction
        return KV_MEMORY_FRACTION if given is None else given

    @property
    def batch_wait(self) -> float:
        """--batch-wait-us in seconds, as the scheduler takes it."""
        return self.batch_wait_us * 1e-6
