// Types of the Node.js client of the mtpdraft.v1.Drafter service (index.js).

import type { ChannelCredentials, ChannelOptions, Metadata, ServiceClientConstructor } from '@grpc/grpc-js';

export type DType = 'DTYPE_FP32' | 'DTYPE_BF16' | 'DTYPE_FP16' | 'DTYPE_INT32';

/** A tensor on the wire: raw little-endian bytes with a dtype and a shape. */
export interface TensorMessage {
  dtype: DType;
  shape: number[];
  data: Buffer;
}

export declare const Tensor: {
  /** An fp32 tensor from numbers (array or Float32Array); shape defaults to [values.length]. */
  fp32(values: ArrayLike<number>, shape?: number[]): TensorMessage;
  /** An int32 tensor (e.g. an xgrammar bitmask, shape [words] or [rows, words]). */
  int32(values: ArrayLike<number>, shape?: number[]): TensorMessage;
  /** A tensor from raw little-endian bytes, checked against its dtype and shape. */
  raw(dtype: DType, shape: number[], data: Uint8Array): TensorMessage;
};

/** A uint64 id: allocState returns decimal strings; BigInts and safe integers are taken too. */
export type Id = string | bigint | number;

/**
 * How a state's drafts are chosen, vLLM's sampling parameters (each absent: 0). Temperature
 * 0 is greedy; above 0 each draft is drawn from q, the head's distribution after temperature,
 * minP, topK and topP, and the answer carries q. A draw depends only on (seed, state,
 * position, draft index).
 */
export interface SamplingParams {
  temperature?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  seed?: number | bigint | string;
}

/** The verdict on a state's pending proposal: how many drafts the target accepted. */
export interface Verdict {
  numAccepted: number;
  /** [numAccepted, hiddenSize]: the target's hiddens of the accepted drafts, refed. */
  refeedHiddens?: TensorMessage | null;
}

export interface ProposeArgs {
  token: number;
  /** The target hidden at position - 1. */
  hidden: TensorMessage;
  position: number | bigint;
  numDrafts: number;
  /** xgrammar's packed int32 bitmask, [words] or [numDrafts, words]. */
  bitmask?: TensorMessage | null;
  minConfidence?: number;
  /** The fused verdict on the pending proposal (its AfterVerify). */
  previous?: Verdict | null;
  /**
   * The state's step number, increasing (0 or absent: not numbered): sent again while its
   * proposal is pending, the step is answered as it was and applied once, so a step whose
   * outcome is unknown (DEADLINE_EXCEEDED, UNAVAILABLE) is safe to resend.
   */
  stepNumber?: number | bigint | string;
  /** For a state with a grammar: answer its bitmask at each draft's and the bonus position. */
  returnBitmasks?: boolean;
  /** The state's sampling from this step on. */
  sampling?: SamplingParams | null;
  /** The state's grammar from this step's token on ({ none: true }: none; absent: kept). */
  grammar?: Grammar | null;
  /** With numDrafts 0 (the drafter chooses K): the most drafts (0: maxDrafts) ... */
  draftCap?: number;
  /** ... for the most tokens per unit of verify cost: one more token's share of a verify step. */
  verifyTokenCost?: number;
}

/** One state of a batch given state by state (batchOf). */
export interface BatchRequest extends ProposeArgs {
  stateId: Id;
}

export interface Proposal {
  stateId: string;
  tokens: number[];
  probs: number[];
  confidence: number;
  firstPosition: number;
  /** Asked with returnBitmasks, for a state with a grammar: int32 [tokens + 1, words]. */
  bitmasks?: TensorMessage;
  /** Sampled drafts: each draft's q, [tokens][qSupport] ids (most probable first) and
   * probabilities (probs[j] is q(tokens[j])). */
  qSupport?: number;
  qIds?: number[][];
  qProbs?: number[][];
}

export interface Rows {
  numRows: number;
  nextPosition: number;
}

export interface PrefillResult extends Rows {
  chunks: number;
}

export interface KVHandle {
  handleId: string;
  numRows: number;
  ttlSeconds: number;
}

/** GetInfo: the model shape, limits and live counters (int64 map values as decimal strings). */
export interface ServerInfo {
  modelFamily: string;
  hiddenSize: number;
  vocabSize: number;
  numAttentionHeads: number;
  numKeyValueHeads: number;
  headDim: number;
  computeDtype: string;
  hiddenDtypes: DType[];
  device: string;
  maxDrafts: number;
  maxBatch: number;
  maxStates: number;
  liveStates: number;
  kvBlockSize: number;
  kvBlocksTotal: number;
  kvBlocksFree: number;
  kvHandles: number;
  stateTtlSeconds: number;
  maxMessageBytes: number;
  bitmaskWords: number;
  draining: boolean;
  batchSizeCounts: Record<string, string>;
  queuedCalls: number;
  /** The kinds of Grammar allocState takes ("json_schema", ...); empty: no grammars. */
  grammarKinds: string[];
}

/** What every draft of a state obeys: exactly one kind (JSON may be given as an object). */
export type Grammar =
  | { jsonSchema: string | object }
  | { ebnf: string }
  | { regex: string }
  | { structuralTag: string | object }
  /** No grammar: on a propose, the state's grammar is cleared from that step on. */
  | { none: true };

/** A verifier's step for B states, as columns: row i of every column is stateIds[i]'s. */
export interface Batch {
  stateIds: BigUint64Array | Iterable<bigint | number | string>;
  tokens: Int32Array | Iterable<number>;
  positions: BigInt64Array | Float64Array | Iterable<number | bigint>;
  /** [B, hiddenSize]: the target hidden of each last token. */
  hiddens: TensorMessage;
  /** B values of K, or one for all. */
  numDrafts: Int32Array | Iterable<number> | number;
  /** B verdicts on the pending proposals, -1 where a state has none. */
  numAccepted?: Int32Array | Iterable<number> | null;
  refeedRows?: Int32Array | Iterable<number> | null;
  refeedHiddens?: TensorMessage | null;
  bitmaskRows?: Int32Array | Iterable<number> | null;
  bitmasks?: TensorMessage | null;
  minConfidence?: Float32Array | Iterable<number> | number | null;
  /** B step numbers (ProposeArgs.stepNumber), or one for all. */
  stepNumbers?: BigUint64Array | Iterable<bigint | number | string> | bigint | number | null;
  /** Answer each grammar state's bitmasks (BatchResult.bitmaskRows, bitmasks). */
  returnBitmasks?: boolean;
  /** The rows (ascending, each once) whose states take new sampling from this step on ... */
  samplingRows?: Int32Array | Iterable<number> | null;
  /** ... and their parameters, one per row listed. */
  sampling?: SamplingParams[] | null;
  /** The rows (ascending, each once) whose states take a grammar (or none) from this step on ... */
  grammarRows?: Int32Array | Iterable<number> | null;
  /** ... and those grammars, one per row listed; one refused fails its row alone. */
  grammars?: Grammar[] | null;
  /** For rows with numDrafts 0: B values, or one for all (ProposeArgs.draftCap). */
  draftCaps?: Int32Array | Iterable<number> | number | null;
  /** For rows with numDrafts 0: B values, or one for all (ProposeArgs.verifyTokenCost). */
  verifyTokenCosts?: Float32Array | Iterable<number> | number | null;
}

/** A batch's answer as typed arrays: row i is stateIds[i]'s. */
export interface BatchResult {
  /** The batch's states, as decimal strings. */
  stateIds: string[];
  width: number;
  /** [B * width] row-major: row i's counts[i] drafts, then -1. */
  drafts: Int32Array;
  probs: Float32Array;
  counts: Int32Array;
  confidences: Float32Array;
  firstPositions: Float64Array;
  /** The failed rows: row -> its error (that state is unchanged). */
  errors: Map<number, DrafterError>;
  /** With returnBitmasks: each row's rows of bitmasks (counts[i] + 1 for a grammar state). */
  bitmaskRows: Int32Array;
  bitmasks: TensorMessage | null;
  /** When some row was sampled: each draft's q, [B * width * qSupport] row-major (a greedy
   * row's q is its draft alone at 1; past a row's count, 0); else 0 and empty. */
  qSupport: number;
  qIds: Int32Array;
  qProbs: Float32Array;
  /** Row `row` as a Proposal; throws its error if it failed. */
  proposal(row: number): Proposal;
}

/** The Batch of states given one by one: row i is requests[i]'s. */
export declare function batchOf(requests: BatchRequest[]): Batch;

/** What a verifier does next, per row: keep numAccepted drafts (the verdict the next
 * proposeBatch or propose carries), then emit nextTokens (the correction or the bonus token). */
export interface Accepted {
  numAccepted: Int32Array;
  nextTokens: Int32Array;
}

export interface AcceptOptions {
  /** Drafts per row, 0 to K (default: K for every row); drafts past a count are never read. */
  counts?: ArrayLike<number> | null;
  /** [B][K + 1] in [0, 1): one per draft's test, the last for the token after. */
  uniforms?: ArrayLike<ArrayLike<number>> | null;
  /** Draws the uniforms when none are given (default Math.random). */
  random?: () => number;
}

/**
 * The verifier's half of speculative sampling, in float64: draft j is kept if
 * u[j] * q_j(draft) < p_j(draft), up to the first refused; the next token is drawn (inverse
 * CDF at u[K]) from max(p - q, 0) normalised at the first refused (p itself where that has no
 * mass), else from p at position count (the bonus token). The Python client's
 * sampling.accept, token for token. Throws a RangeError on inputs that do not fit.
 * @param drafts [B][K] each row's drafts
 * @param qIds [B][K][T] each draft's q: its support (T may vary; greedy drafts: T = 1)
 * @param qProbs [B][K][T] and its probabilities (padding: 0; greedy drafts: 1)
 * @param targetProbs [B][K + 1][V] the target's distribution at each draft's position, then
 *   at the position after the last draft
 */
export declare function accept(
  drafts: ArrayLike<ArrayLike<number>>,
  qIds: ArrayLike<ArrayLike<ArrayLike<number>>>,
  qProbs: ArrayLike<ArrayLike<ArrayLike<number>>>,
  targetProbs: ArrayLike<ArrayLike<ArrayLike<number>>>,
  options?: AcceptOptions,
): Accepted;

/**
 * accept over a batch's answer as it is: its drafts, q (one-hot where no row was sampled) and
 * counts; targetProbs [B][width + 1][V]. The verdicts are the next step's numAccepted and
 * tokens.
 */
export declare function acceptBatch(
  result: BatchResult,
  targetProbs: ArrayLike<ArrayLike<ArrayLike<number>>>,
  options?: Omit<AcceptOptions, 'counts'>,
): Accepted;

/** A failed call, a failed row, or a stream message the server refused. */
export declare class DrafterError extends Error {
  constructor(
    err: { code: number; details?: string; message?: string; metadata?: Metadata },
    detail?: { reason: string | null; field: string | null },
  );
  /** The gRPC status number. */
  code: number;
  /** Its name, e.g. "NOT_FOUND". */
  codeName: string;
  details: string | undefined;
  /** google.rpc.ErrorInfo's reason, e.g. "STATE_NOT_FOUND" (null if none). */
  reason: string | null;
  /** google.rpc.BadRequest's field at fault (null if none). */
  field: string | null;
  /** A failed call's trailers (undefined for a stream message's error). */
  metadata: Metadata | undefined;
}

export interface StreamOptions {
  /** The whole stream's deadline in ms; 0 (the default): none. The client's timeoutMs is not applied. */
  timeoutMs?: number;
}

/** One ProposeStream call: one batch and one answer per verify step; many in flight. */
export declare class ProposeStream {
  private constructor();
  step(batch: Batch): Promise<BatchResult>;
  /** One state, a batch of one; rejects with its error if it failed. */
  propose(stateId: Id, args: ProposeArgs): Promise<Proposal>;
  /** Ends the writing side; resolves once the answers in flight have arrived. Never rejects. */
  close(): Promise<void>;
}

export interface DrafterClientOptions {
  /** The deadline in ms of every unary call and prefill (default 30000; 0: none), never of a stream. */
  timeoutMs?: number;
  /** Default: insecure. */
  credentials?: ChannelCredentials;
  channelOptions?: ChannelOptions;
  /** The folder holding mtpdraft/v1/drafter.proto (default: the package's own copy). */
  protoRoot?: string;
  /** Sent with every call as the x-mtpdraft-affinity metadata: a proxy in front of several
   * replicas sends all of a key's calls to one of them (deploy/README.md). */
  affinityKey?: string;
}

export declare class DrafterClient {
  /** @param address host:port of the server */
  constructor(address: string, options?: DrafterClientOptions);
  timeoutMs: number;
  affinityKey: string | null;
  close(): void;
  getInfo(): Promise<ServerInfo>;
  /** A new, empty state, with a grammar its drafts obey and sampling parameters if given;
   * resolves to its id. */
  allocState(grammar?: Grammar | null, options?: { sampling?: SamplingParams | null }): Promise<string>;
  /** Appends committed rows (tokens[i], hiddens[i]) at startPosition + i. All or nothing. */
  prefill(
    stateId: Id,
    startPosition: number | bigint,
    tokens: ArrayLike<number>,
    hiddens: TensorMessage,
    options?: { chunkRows?: number },
  ): Promise<PrefillResult>;
  propose(stateId: Id, args: ProposeArgs): Promise<Proposal>;
  /** A verifier's whole step for B states; a failed row has its error in `errors`. */
  proposeBatch(batch: Batch): Promise<BatchResult>;
  /** The hot path: a ProposeStream, with no deadline unless options.timeoutMs asks. */
  stream(options?: StreamOptions): ProposeStream;
  afterVerify(stateId: Id, numAccepted: number, refeedHiddens?: TensorMessage | null): Promise<Rows>;
  takeKV(stateId: Id): Promise<KVHandle>;
  installKV(stateId: Id, handleId: Id): Promise<Rows>;
  /** Releases the state; resolves to whether it existed. Idempotent. */
  freeState(stateId: Id): Promise<boolean>;
}

/** The generated service client class of mtpdraft.v1.Drafter (the proto loaded at run time). */
export declare function loadService(protoRoot?: string): ServiceClientConstructor;
