'use strict';
// Node.js client of the mtpdraft.v1.Drafter service (protos/mtpdraft/v1/drafter.proto).
//
//   const { DrafterClient, Tensor } = require('mtpdraft-client');
//   const drafter = new DrafterClient('localhost:50051', { timeoutMs: 5000 });
//   const state = await drafter.allocState();
//   await drafter.prefill(state, 1, tokens, Tensor.fp32(hiddens, [n, hiddenSize]));
//   const p = await drafter.propose(state, { token, hidden, position, numDrafts: 3 });
//   await drafter.afterVerify(state, accepted);
//   await drafter.freeState(state);
//
// A verifier that steps many states at once sends the whole step as one batch of columns,
// typed arrays in and out (row i of every column is state i's); per-row failures come back in
// `errors` (batchOf makes the columns from states given one by one):
//
//   const step = await drafter.proposeBatch({
//     stateIds, // B ids: allocState's strings, BigInts or a BigUint64Array
//     tokens, // Int32Array [B]
//     positions, // Float64Array or BigInt64Array [B]
//     hiddens, // Tensor [B, hiddenSize]
//     numDrafts: 3, // or B values
//     numAccepted, // optional, Int32Array [B]: the verdicts on the pending proposals, -1 for none
//   });
//   // step.drafts: Int32Array [B * step.width], row i's step.counts[i] drafts then -1;
//   // step.errors: Map row -> DrafterError (that state is unchanged).
//
// The hot path is one round trip per verify step: a ProposeStream, one batch a message, each
// state's verdict on its last proposal riding with its next proposal's inputs. One stream
// serves many states, with many messages in flight; each answer settles its own promise.
//
//   const stream = drafter.stream(); // no deadline: lives as long as the verifier
//   const next = await stream.step({ stateIds, tokens, positions, hiddens, numDrafts: 3, numAccepted });
//   // One state is a batch of one; propose() sends it and resolves to its Proposal:
//   let proposal = await stream.propose(state, { token, hidden, position, numDrafts: 3 });
//   // The target accepted `a` of proposal.tokens and sampled `bonus`; h is its hidden at
//   // proposal.firstPosition + a - 1.
//   proposal = await stream.propose(state, {
//     token: bonus, hidden: h, position: proposal.firstPosition + a, numDrafts: 3,
//     previous: { numAccepted: a }, // optionally refeedHiddens: the target's hiddens, [a, hiddenSize]
//   });
//   await stream.close(); // once the verifier is done with it
//
// State and handle ids are uint64: they travel as decimal strings. Tensors are
// { dtype: 'DTYPE_FP32' | 'DTYPE_BF16' | 'DTYPE_FP16' | 'DTYPE_INT32', shape, data: Buffer }
// with data the raw little-endian bytes. A failed call rejects with a DrafterError; so does a
// stream message that the server refused as a whole (the stream stays open).
//
// Deadlines: the client's timeoutMs (default 30 s) bounds each unary call and each prefill. A
// stream (stream()) has no deadline unless its own { timeoutMs } asks for one.
//
// The verifier's verdicts on sampled (or greedy, one-hot q) drafts: accept(drafts, qIds, qProbs,
// targetProbs, { counts, uniforms }) (sampling.js) gives { numAccepted, nextTokens }, the Python
// client's sampling.accept token for token.

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protobuf = require('protobufjs');
const protoLoader = require('@grpc/proto-loader');
const { accept, acceptBatch } = require('./sampling.js');

const PROTO_FILE = 'mtpdraft/v1/drafter.proto';
// The repository's proto when this is client/node of a checkout, else the package's own copy
// (proto/, written by the prepare script when npm packs or installs the folder).
const REPO_PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_ROOT =
  path.basename(path.dirname(__dirname)) === 'client' && fs.existsSync(path.join(REPO_PROTOS, PROTO_FILE))
    ? REPO_PROTOS
    : path.join(__dirname, 'proto');
const DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024;
const ITEMSIZE = { DTYPE_BF16: 2, DTYPE_FP16: 2, DTYPE_FP32: 4, DTYPE_INT32: 4 };
const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));
const LITTLE_ENDIAN = os.endianness() === 'LE';

let cachedService = null;

const GRAMMAR_KINDS = ['jsonSchema', 'ebnf', 'regex', 'structuralTag'];

// A Grammar message from { kind: source }: exactly one kind, an object source as JSON text, or
// { none: true } (no grammar: on a propose, the state's is cleared).
function grammarMessage(grammar) {
  if (grammar === null || typeof grammar !== 'object') {
    throw new TypeError(`grammar: expected an object, got ${grammar === null ? 'null' : typeof grammar}`);
  }
  const given = (k) => grammar[k] !== undefined && grammar[k] !== null && (k !== 'none' || grammar[k] !== false);
  const kinds = Object.keys(grammar).filter(given);
  if (kinds.length !== 1 || !(GRAMMAR_KINDS.includes(kinds[0]) || grammar.none === true)) {
    throw new RangeError(`grammar: exactly one of ${GRAMMAR_KINDS.join(', ')}, none: true, got [${kinds}]`);
  }
  if (kinds[0] === 'none') return { none: true };
  const source = grammar[kinds[0]];
  return { [kinds[0]]: typeof source === 'string' ? source : JSON.stringify(source) };
}

function loadService(protoRoot = PROTO_ROOT) {
  if (protoRoot === PROTO_ROOT && cachedService) return cachedService;
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [protoRoot],
    keepCase: false, // camelCase field names
    longs: String, // (u)int64 as decimal strings: ids do not fit in a double
    enums: String,
    defaults: true,
  });
  const service = grpc.loadPackageDefinition(definition).mtpdraft.v1.Drafter;
  if (protoRoot === PROTO_ROOT) cachedService = service;
  return service;
}

/**
 * A failed RPC, a failed batch row, or a ProposeStream message the server refused: `code` is
 * the gRPC status number, `codeName` its name ("NOT_FOUND"), `reason` the machine-readable
 * reason (google.rpc.ErrorInfo) and `field` the offending request field (google.rpc.BadRequest),
 * each null when the server sent none. `metadata` is the trailers of a failed call (undefined
 * for an error carried as a value).
 */
class DrafterError extends Error {
  constructor(err, { reason, field } = richDetails(err.metadata)) {
    const codeName = STATUS_NAMES[err.code] ?? 'UNKNOWN';
    super(`${codeName}: ${err.details || err.message}`);
    this.name = 'DrafterError';
    this.code = err.code;
    this.codeName = codeName;
    this.details = err.details;
    this.reason = reason;
    this.field = field;
    this.metadata = err.metadata;
  }
}

const ERROR_INFO_TYPE = 'type.googleapis.com/google.rpc.ErrorInfo';
const BAD_REQUEST_TYPE = 'type.googleapis.com/google.rpc.BadRequest';

// google.rpc.Status and the two details the server attaches, declared with the fields read
// here (the wire format of googleapis' own definitions, without shipping them).
const RICH_STATUS = protobuf.parse(`
  syntax = "proto3";
  package google.rpc;
  message Any { string type_url = 1; bytes value = 2; }
  message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
  message ErrorInfo { string reason = 1; string domain = 2; }
  message FieldViolation { string field = 1; string description = 2; }
  message BadRequest { repeated FieldViolation field_violations = 1; }
`, { keepCase: true }).root;
const [StatusType, ErrorInfoType, BadRequestType] = ['Status', 'ErrorInfo', 'BadRequest'].map(
  (name) => RICH_STATUS.lookupType(`google.rpc.${name}`),
);

// reason and field from the google.rpc.Status the server attaches to a failed call
// (grpc-status-details-bin), so that unary and stream errors carry the same fields.
function richDetails(metadata) {
  const out = { reason: null, field: null };
  const [status] = metadata?.get?.('grpc-status-details-bin') ?? [];
  if (!Buffer.isBuffer(status)) return out;
  try {
    for (const any of StatusType.decode(status).details) {
      if (any.type_url === ERROR_INFO_TYPE) {
        out.reason ??= ErrorInfoType.decode(any.value).reason || null;
      } else if (any.type_url === BAD_REQUEST_TYPE) {
        out.field ??= BadRequestType.decode(any.value).field_violations[0]?.field || null;
      }
    }
  } catch {
    // Malformed details: the code and message still say what failed.
  }
  return out;
}

// The DrafterError of an Error carried as a value (a failed row, a refused stream message).
function errorFromValue(error) {
  return new DrafterError(
    { code: error.code, details: error.message },
    { reason: error.reason || null, field: error.field || null },
  );
}

// Why a ProposeStream message got no answer: the stream ended (closed or finished by the server).
function streamClosedError() {
  return new DrafterError({ code: grpc.status.UNAVAILABLE, details: 'the propose stream is closed' });
}

/** Tensor helpers: raw little-endian bytes plus dtype and shape. */
const Tensor = {
  /** An fp32 tensor from numbers (array or Float32Array), written little-endian. */
  fp32(values, shape) {
    if (values instanceof Float32Array && LITTLE_ENDIAN) {
      return Tensor.raw('DTYPE_FP32', shape ?? [values.length], bytesOf(values));
    }
    const data = Buffer.alloc(values.length * 4);
    for (let i = 0; i < values.length; i++) data.writeFloatLE(values[i], i * 4);
    return Tensor.raw('DTYPE_FP32', shape ?? [values.length], data);
  },
  /** An int32 tensor (e.g. an xgrammar bitmask, shape [words] or [rows, words]). */
  int32(values, shape) {
    if (values instanceof Int32Array && LITTLE_ENDIAN) {
      return Tensor.raw('DTYPE_INT32', shape ?? [values.length], bytesOf(values));
    }
    const data = Buffer.alloc(values.length * 4);
    for (let i = 0; i < values.length; i++) data.writeInt32LE(values[i] | 0, i * 4);
    return Tensor.raw('DTYPE_INT32', shape ?? [values.length], data);
  },
  /** A tensor from raw little-endian bytes, checked against its dtype and shape. */
  raw(dtype, shape, data) {
    const size = ITEMSIZE[dtype];
    if (!size) throw new TypeError(`unknown dtype ${dtype}`);
    const count = shape.reduce((a, b) => a * b, 1);
    if (data.length !== count * size) {
      throw new RangeError(`shape [${shape}] ${dtype} needs ${count * size} bytes, got ${data.length}`);
    }
    return { dtype, shape: shape.map(Number), data: Buffer.from(data) };
  },
};

// A typed array's bytes, without a copy (Tensor.raw copies them).
function bytesOf(array) {
  return Buffer.from(array.buffer, array.byteOffset, array.byteLength);
}

function verdictMessage(previous) {
  const msg = { numAccepted: previous.numAccepted };
  if (previous.refeedHiddens) msg.refeedHiddens = previous.refeedHiddens;
  return msg;
}

function parseRows(resp) {
  return { numRows: Number(resp.numRows), nextPosition: Number(resp.nextPosition) };
}

// A SamplingParams message from { temperature, topK, topP, minP, seed } (each optional: 0).
function samplingMessage({ temperature = 0, topK = 0, topP = 0, minP = 0, seed = 0 }) {
  return {
    temperature: column([temperature], 'sampling.temperature', floatValue)[0],
    topK: column([topK], 'sampling.topK', int32Value)[0],
    topP: column([topP], 'sampling.topP', floatValue)[0],
    minP: column([minP], 'sampling.minP', floatValue)[0],
    seed: column([seed], 'sampling.seed', uint64Value)[0],
  };
}

// The ProposeRequest of propose's arguments.
function proposeRequest(
  stateId,
  {
    token, hidden, position, numDrafts, bitmask, minConfidence, previous, stepNumber, returnBitmasks,
    sampling, draftCap, verifyTokenCost, grammar,
  },
) {
  const req = { stateId, token, hidden, position, numDrafts, minConfidence: minConfidence ?? 0 };
  if (stepNumber) req.stepNumber = column([stepNumber], 'stepNumber', uint64Value)[0];
  if (returnBitmasks) req.returnBitmasks = true;
  if (sampling) req.sampling = samplingMessage(sampling);
  if (grammar) req.grammar = grammarMessage(grammar);
  if (draftCap) req.draftCap = draftCap;
  if (verifyTokenCost) req.verifyTokenCost = verifyTokenCost;
  if (bitmask) req.bitmask = bitmask;
  if (previous) req.previous = verdictMessage(previous);
  return req;
}

function parseProposal(p) {
  return {
    stateId: p.stateId,
    tokens: p.tokens,
    probs: p.probs,
    confidence: p.confidence,
    firstPosition: Number(p.firstPosition),
    // Sampled drafts: each one's q, [tokens][qSupport] ids and probabilities.
    ...(p.qSupport ? qOf(p.qIds, p.qProbs, p.tokens.length, p.qSupport) : {}),
    // With returnBitmasks, for a state with a grammar: its bitmasks (a Tensor message).
    ...(p.bitmasks ? { bitmasks: p.bitmasks } : {}),
  };
}

// { qSupport, qIds, qProbs } of n drafts' flat q ([n * support] each), as [n][support] arrays.
function qOf(ids, probs, n, support) {
  if (ids.length !== n * support || probs.length !== n * support) {
    throw new DrafterError({ code: grpc.status.UNKNOWN, details: `a malformed answer: q of ${ids.length} ids` });
  }
  const rows = (flat) => Array.from({ length: n }, (_, j) => Array.from(flat.slice(j * support, (j + 1) * support)));
  return { qSupport: support, qIds: rows(ids), qProbs: rows(probs) };
}

/**
 * @typedef {{ dtype: 'DTYPE_FP32' | 'DTYPE_BF16' | 'DTYPE_FP16' | 'DTYPE_INT32',
 *   shape: number[], data: Buffer }} TensorMessage
 * @typedef {{ numAccepted: number, refeedHiddens?: TensorMessage | null }} Verdict
 * @typedef {{ temperature?: number, topK?: number, topP?: number, minP?: number,
 *   seed?: number | bigint | string }} SamplingParams
 * @typedef {{ stateId: string, tokens: number[], probs: number[], confidence: number,
 *   firstPosition: number }} Proposal
 * @typedef {{ stateId: string | bigint | number, token: number, hidden: TensorMessage,
 *   position: number | bigint, numDrafts: number, bitmask?: TensorMessage | null,
 *   minConfidence?: number, previous?: Verdict | null,
 *   stepNumber?: number | bigint | string }} BatchRequest
 */

/**
 * A verifier's step for B states, as columns (a ProposeBatch, or a ProposeStream message): row
 * i of every column is stateIds[i]'s.
 * Integer columns take a typed array or an array of numbers (or of BigInts); the uint64
 * stateIds also decimal strings (as allocState returns them), the int64 positions also a
 * BigInt64Array or a Float64Array. Columns that do not fit together (lengths, shapes) are
 * refused by the server as a whole: INVALID_ARGUMENT naming the column.
 *
 * @typedef {object} Batch
 * @property {BigUint64Array | Iterable<bigint | number | string>} stateIds B states
 * @property {Int32Array | Iterable<number>} tokens B values: each state's last token
 * @property {BigInt64Array | Float64Array | Iterable<number | bigint>} positions B values:
 *   each last token's position
 * @property {TensorMessage} hiddens [B, hiddenSize]: the target hidden of each last token
 * @property {Int32Array | Iterable<number> | number} numDrafts B values of K, or one for all
 * @property {Int32Array | Iterable<number> | null} [numAccepted] B verdicts on the pending
 *   proposals, -1 where a state has none (absent: no verdicts)
 * @property {Int32Array | Iterable<number> | null} [refeedRows] B counts of refeedHiddens
 *   rows, each 0 or the state's numAccepted
 * @property {TensorMessage | null} [refeedHiddens] [sum(refeedRows), hiddenSize], state by
 *   state
 * @property {Int32Array | Iterable<number> | null} [bitmaskRows] B counts of bitmasks rows,
 *   each 0 (no mask) or 1 .. K
 * @property {TensorMessage | null} [bitmasks] [sum(bitmaskRows), bitmaskWords] int32
 * @property {Float32Array | Iterable<number> | number | null} [minConfidence] B values, or
 *   one for all (absent: draft all K)
 * @property {BigUint64Array | Iterable<bigint | number | string> | bigint | number | null}
 *   [stepNumbers] B step numbers, or one for all (absent: not numbered): a numbered step sent
 *   again while its proposal is pending is answered as it was, and applied once
 * @property {Int32Array | Iterable<number> | null} [samplingRows] the rows (ascending, each
 *   once) whose states take new sampling from this step on
 * @property {SamplingParams[] | null} [sampling] their parameters, one per row listed
 * @property {Int32Array | Iterable<number> | null} [grammarRows] the rows (ascending, each
 *   once) whose states take a grammar, or { none: true }, from this step on
 * @property {Grammar[] | null} [grammars] those grammars, one per row listed (one refused fails
 *   its row alone, field grammars)
 * @property {Int32Array | Iterable<number> | number | null} [draftCaps] for rows with
 *   numDrafts 0 (the drafter chooses K): the most drafts it may choose (0: maxDrafts); B
 *   values, or one for all
 * @property {Float32Array | Iterable<number> | number | null} [verifyTokenCosts] and what
 *   verifying one more token costs, as a fraction of a verify step; B values, or one for all
 */

/**
 * A batch's answer as typed arrays: row i is stateIds[i]'s. A row that failed has count 0,
 * drafts -1, probs 0, and its error in `errors`; its state is unchanged.
 *
 * @typedef {object} BatchResult
 * @property {string[]} stateIds B values: the batch's states (decimal strings)
 * @property {number} width columns of drafts and probs: the largest K asked
 * @property {Int32Array} drafts [B * width] row-major: row i's counts[i] drafts, then -1
 * @property {Float32Array} probs [B * width]: each draft's top-1 probability, then 0
 * @property {Int32Array} counts B values: the drafts in each row
 * @property {Float32Array} confidences B values: each row's chain confidence
 * @property {Float64Array} firstPositions B values: the position of each row's first draft
 *   (int64 positions as numbers, as Proposal.firstPosition)
 * @property {Map<number, DrafterError>} errors the failed rows: row -> its error
 * @property {(row: number) => Proposal} proposal row `row` as a Proposal; throws its error if
 *   it failed
 */

const INT32_MIN = -(2 ** 31);
const INT32_MAX = 2 ** 31 - 1;
const UINT64_MAX = 2n ** 64n - 1n;
const INT64_MIN = -(2n ** 63n);
const INT64_MAX = 2n ** 63n - 1n;

// A column's values as the plain array the serializer takes (it refuses typed arrays), each
// checked to be one the wire can carry. A bare value is a column of one where `oneForAll`.
function column(values, name, convert, { oneForAll = false } = {}) {
  if (oneForAll && (typeof values === 'number' || typeof values === 'bigint')) values = [values];
  if (values == null || typeof values === 'string' || typeof values[Symbol.iterator] !== 'function') {
    throw new TypeError(`${name}: expected an array or a typed array, got ${typeof values}`);
  }
  return Array.from(values, (v, i) => {
    const out = convert(v);
    if (out === undefined) throw new RangeError(`${name}[${i}]: ${String(v)} does not fit the column`);
    return out;
  });
}

// BigInt of an integer given as a number, a BigInt or a decimal string, or undefined.
function bigIntOf(v) {
  if (typeof v === 'bigint') return v;
  if (typeof v === 'number') return Number.isSafeInteger(v) ? BigInt(v) : undefined;
  if (typeof v === 'string' && /^-?[0-9]+$/.test(v)) return BigInt(v);
  return undefined;
}

const int32Value = (v) => {
  const n = typeof v === 'bigint' ? Number(v) : v;
  return Number.isInteger(n) && n >= INT32_MIN && n <= INT32_MAX ? n : undefined;
};
const uint64Value = (v) => {
  const n = bigIntOf(v);
  return n !== undefined && n >= 0n && n <= UINT64_MAX ? n.toString() : undefined;
};
const int64Value = (v) => {
  if (Number.isSafeInteger(v)) return v;
  const n = bigIntOf(v);
  return n !== undefined && n >= INT64_MIN && n <= INT64_MAX ? n.toString() : undefined;
};
const floatValue = (v) => (typeof v === 'number' ? v : undefined);

// The ProposeBatchRequest of a Batch (unary and stream alike). Optional columns left out are
// sent empty, which the contract reads as "none".
function batchRequest(step) {
  const req = {
    stateIds: column(step.stateIds, 'stateIds', uint64Value),
    tokens: column(step.tokens, 'tokens', int32Value),
    positions: column(step.positions, 'positions', int64Value),
    hiddens: step.hiddens,
    numDrafts: column(step.numDrafts, 'numDrafts', int32Value, { oneForAll: true }),
  };
  for (const name of ['numAccepted', 'refeedRows', 'bitmaskRows']) {
    if (step[name] != null) req[name] = column(step[name], name, int32Value);
  }
  if (step.refeedHiddens) req.refeedHiddens = step.refeedHiddens;
  if (step.bitmasks) req.bitmasks = step.bitmasks;
  if (step.minConfidence != null) {
    req.minConfidence = column(step.minConfidence, 'minConfidence', floatValue, { oneForAll: true });
  }
  if (step.stepNumbers != null) {
    req.stepNumbers = column(step.stepNumbers, 'stepNumbers', uint64Value, { oneForAll: true });
  }
  if (step.samplingRows != null) {
    req.samplingRows = column(step.samplingRows, 'samplingRows', int32Value);
    req.sampling = Array.from(step.sampling ?? [], samplingMessage);
  }
  if (step.grammarRows != null) {
    req.grammarRows = column(step.grammarRows, 'grammarRows', int32Value);
    req.grammars = Array.from(step.grammars ?? [], grammarMessage);
  }
  if (step.draftCaps != null) {
    req.draftCaps = column(step.draftCaps, 'draftCaps', int32Value, { oneForAll: true });
  }
  if (step.verifyTokenCosts != null) {
    req.verifyTokenCosts = column(step.verifyTokenCosts, 'verifyTokenCosts', floatValue, { oneForAll: true });
  }
  if (step.returnBitmasks) req.returnBitmasks = true;
  return req;
}

/** The answer to the batch `req`. @returns {BatchResult} */
function parseBatch(resp, req) {
  const errors = new Map();
  for (const { row, error } of resp.errors) {
    errors.set(row, errorFromValue(error ?? { code: grpc.status.UNKNOWN, message: 'empty row error' }));
  }
  const result = {
    stateIds: req.stateIds,
    width: resp.width,
    drafts: Int32Array.from(resp.drafts),
    probs: Float32Array.from(resp.probs),
    counts: Int32Array.from(resp.draftCounts),
    confidences: Float32Array.from(resp.confidences),
    firstPositions: Float64Array.from(resp.firstPositions, Number),
    errors,
    // With returnBitmasks: each row's rows of `bitmasks` (counts[i] + 1 for a grammar state).
    bitmaskRows: Int32Array.from(resp.bitmaskRows ?? []),
    bitmasks: resp.bitmasks ?? null,
    // When some row was sampled: each draft's q, [B * width * qSupport] (0 past a count).
    qSupport: resp.qSupport ?? 0,
    qIds: Int32Array.from(resp.qIds ?? []),
    qProbs: Float32Array.from(resp.qProbs ?? []),
  };
  const cells = result.counts.length * result.width * result.qSupport;
  if (result.qIds.length !== cells || result.qProbs.length !== cells) {
    throw new DrafterError({ code: grpc.status.UNKNOWN, details: `a malformed answer: q of ${result.qIds.length} ids` });
  }
  result.proposal = (row) => {
    if (errors.has(row)) throw errors.get(row);
    const lo = row * result.width;
    const hi = lo + result.counts[row];
    const support = result.qSupport;
    return {
      stateId: result.stateIds[row],
      tokens: Array.from(result.drafts.subarray(lo, hi)),
      probs: Array.from(result.probs.subarray(lo, hi)),
      confidence: result.confidences[row],
      firstPosition: result.firstPositions[row],
      ...(support
        ? qOf(result.qIds.subarray(lo * support, hi * support), result.qProbs.subarray(lo * support, hi * support),
          hi - lo, support)
        : {}),
    };
  };
  return result;
}

/**
 * The Batch of states given one by one: row i is requests[i]'s ({ stateId } with the arguments
 * of propose). Their hiddens (each [hiddenSize] or [1, hiddenSize]) are stacked, their refeeds
 * and bitmasks put one after another with each one's row count; bitmasks of fewer words are
 * padded with zero words (which allow no token, as the server reads them). The hiddens, and
 * the refeeds, must share one dtype and width.
 * @param {BatchRequest[]} requests
 * @returns {Batch}
 */
function batchOf(requests) {
  const hiddens = new Rows('hidden');
  const refeeds = new Rows('refeedHiddens');
  const masks = new Rows('bitmask', { pad: true });
  const numAccepted = [];
  const refeedRows = [];
  const bitmaskRows = [];
  requests.forEach((r, i) => {
    if (hiddens.add(r.hidden, i) !== 1) throw new RangeError(`requests[${i}].hidden: one row expected`);
    numAccepted.push(r.previous ? r.previous.numAccepted : -1);
    refeedRows.push(r.previous?.refeedHiddens ? refeeds.add(r.previous.refeedHiddens, i) : 0);
    bitmaskRows.push(r.bitmask ? masks.add(r.bitmask, i) : 0);
  });
  const batch = {
    stateIds: requests.map((r) => r.stateId),
    tokens: requests.map((r) => r.token),
    positions: requests.map((r) => r.position),
    hiddens: hiddens.tensor(),
    numDrafts: requests.map((r) => r.numDrafts),
  };
  if (numAccepted.some((a) => a >= 0)) batch.numAccepted = numAccepted;
  if (refeeds.count) Object.assign(batch, { refeedRows, refeedHiddens: refeeds.tensor() });
  if (masks.count) Object.assign(batch, { bitmaskRows, bitmasks: masks.tensor() });
  if (requests.some((r) => r.minConfidence)) batch.minConfidence = requests.map((r) => r.minConfidence ?? 0);
  if (requests.some((r) => r.stepNumber)) batch.stepNumbers = requests.map((r) => r.stepNumber ?? 0);
  const sampled = requests.flatMap((r, i) => (r.sampling ? [i] : []));
  if (sampled.length) Object.assign(batch, { samplingRows: sampled, sampling: sampled.map((i) => requests[i].sampling) });
  const grammared = requests.flatMap((r, i) => (r.grammar ? [i] : []));
  if (grammared.length) Object.assign(batch, { grammarRows: grammared, grammars: grammared.map((i) => requests[i].grammar) });
  if (requests.some((r) => r.draftCap || r.verifyTokenCost)) {
    batch.draftCaps = requests.map((r) => r.draftCap ?? 0);
    batch.verifyTokenCosts = requests.map((r) => r.verifyTokenCost ?? 0);
  }
  return batch;
}

// The rows of one tensor column, gathered state by state (batchOf).
class Rows {
  constructor(name, { pad = false } = {}) {
    Object.assign(this, { name, pad, dtype: null, width: 0, parts: [], count: 0 });
  }

  // Adds requests[i]'s rows ([n, width], or one row flat); returns how many.
  add(tensor, i) {
    const where = `requests[${i}].${this.name}`;
    const { shape } = tensor;
    if (shape.length < 1 || shape.length > 2) throw new RangeError(`${where}: shape [${shape}]`);
    const [n, width] = shape.length === 1 ? [shape[0] ? 1 : 0, shape[0]] : shape;
    if (!n) return 0;
    if (this.count && tensor.dtype !== this.dtype) {
      throw new TypeError(`${where}: dtype ${tensor.dtype}, where earlier rows are ${this.dtype}`);
    }
    if (this.count && width !== this.width && !this.pad) {
      throw new RangeError(`${where}: ${width} values a row, where earlier rows hold ${this.width}`);
    }
    this.dtype = tensor.dtype;
    this.width = Math.max(this.width, width);
    this.parts.push({ n, width, data: tensor.data });
    this.count += n;
    return n;
  }

  // The rows as one [count, width] tensor, narrower rows padded with zeros.
  tensor() {
    const size = ITEMSIZE[this.dtype];
    const data = Buffer.alloc(this.count * this.width * size);
    let at = 0;
    for (const { n, width, data: rows } of this.parts) {
      for (let r = 0; r < n; r++, at++) {
        rows.copy(data, at * this.width * size, r * width * size, (r + 1) * width * size);
      }
    }
    return Tensor.raw(this.dtype, [this.count, this.width], data);
  }
}

// The request metadata a proxy routes by (deploy/README.md).
const AFFINITY_HEADER = 'x-mtpdraft-affinity';

function deadlineOptions(timeoutMs) {
  return timeoutMs ? { deadline: new Date(Date.now() + timeoutMs) } : {};
}

// One bidirectional call whose answers carry their request's id: each request settles its own
// promise, in whatever order the answers come. `_outcome` turns an answer into its result, or
// the DrafterError to reject with.
class AnswerStream {
  constructor(stub, method, callOptions, metadata = new grpc.Metadata()) {
    this._pending = new Map(); // request id (a decimal string, as answers carry it) -> promise settlers
    this._nextId = 1; // not 0: the proto default must not match a request
    this._ended = false; // true once close() ran or the call failed or ended: no more writes
    this._failure = null; // the call's DrafterError, if it failed
    this._call = stub[method](metadata, callOptions);
    // Pending promises are rejected on 'end', not on 'error' or 'status': grpc-js reports the
    // status as soon as it arrives, while answers received before it may still wait in the
    // readable buffer; 'end' comes after the last of them.
    let unseen = 2; // 'status' and 'end'
    this._finished = new Promise((resolve) => {
      const seen = () => --unseen === 0 && resolve();
      this._call.once('status', seen);
      this._call.once('end', () => {
        this._ended = true;
        const failure = this._failure ?? streamClosedError();
        for (const { reject } of this._pending.values()) reject(failure);
        this._pending.clear();
        seen();
      });
    });
    this._call.on('data', (resp) => this._answer(resp));
    // Also keeps a failed call from being an uncaught 'error' event.
    this._call.on('error', (err) => {
      this._ended = true;
      this._failure = new DrafterError(err);
    });
  }

  _answer(resp) {
    const pending = this._pending.get(resp.requestId);
    if (!pending) return; // not ours (or already settled by the end of the stream)
    this._pending.delete(resp.requestId);
    const outcome = this._outcome(resp, pending.request);
    if (outcome instanceof DrafterError) pending.reject(outcome);
    else pending.resolve(outcome);
  }

  // Sends the request made by `build` (which may throw: nothing is sent then) under a new
  // request id; resolves to its answer's outcome.
  async _send(build) {
    if (this._ended) throw this._failure ?? streamClosedError();
    const req = build();
    req.requestId = String(this._nextId++);
    return await new Promise((resolve, reject) => {
      this._pending.set(req.requestId, { resolve, reject, request: req });
      // No wait on backpressure: grpc-js buffers, and what is in flight is bounded by the
      // caller's pending promises.
      this._call.write(req);
    });
  }

  /**
   * Ends the writing side; resolves once the server has answered the requests in flight and
   * finished the call (at once if it already has). Never rejects: a failure of the call has
   * already rejected the promises it concerns.
   * @returns {Promise<void>}
   */
  async close() {
    if (!this._ended) {
      this._ended = true;
      this._call.end();
    }
    await this._finished;
  }
}

/**
 * The hot path: one ProposeStream call, one message and one answer per verify step (made by
 * DrafterClient.stream()). Each message is a batch (step(), as proposeBatch; propose() sends one
 * state as a batch of one). Many messages may be in flight: answers come as their batches are
 * drafted, possibly out of order, and settle their own promise by request id; two messages
 * naming one state are served in the order sent. A row that fails has its error in the
 * result's `errors`; a message the server refuses as a whole rejects its promise with a
 * DrafterError and leaves the stream open. Once the stream ends (close(), its deadline, a
 * server or network failure) every pending and later message rejects.
 *
 * A message that the serializer rejects (a value of the wrong JavaScript type) makes grpc-js
 * cancel the whole call with INTERNAL, failing the other messages in flight too.
 */
class ProposeStream extends AnswerStream {
  constructor(stub, callOptions, metadata) {
    super(stub, 'ProposeStream', callOptions, metadata);
  }

  _outcome(resp, request) {
    return resp.error ? errorFromValue(resp.error) : parseBatch(resp, request);
  }

  /**
   * One verifier step's round trip: the columns of DrafterClient.proposeBatch. A column the
   * wire cannot carry (a non-integer, a value out of its type's range) throws before anything
   * is sent.
   * @param {Batch} batch
   * @returns {Promise<BatchResult>}
   */
  async step(batch) {
    return await this._send(() => batchRequest(batch));
  }

  /**
   * One state's round trip, a batch of one: the arguments of DrafterClient.propose (usually
   * with `previous` set). Resolves to the Proposal; rejects with a DrafterError.
   * @returns {Promise<Proposal>}
   */
  async propose(stateId, args) {
    const result = await this._send(() => batchRequest(batchOf([{ stateId, ...args }])));
    return result.proposal(0);
  }
}

class DrafterClient {
  /**
   * @param {string} address host:port of the server
   * @param {object} [options] timeoutMs: deadline of every unary call and prefill (default
   *   30000; 0: none), never of a stream (see stream());
   *   credentials (default insecure); channelOptions; protoRoot (folder holding mtpdraft/v1/);
   *   affinityKey: sent with every call as the x-mtpdraft-affinity metadata, by which a proxy
   *   sends all of a key's calls to one replica (deploy/README.md).
   */
  constructor(address, options = {}) {
    const Service = loadService(options.protoRoot);
    this.timeoutMs = options.timeoutMs ?? 30000;
    this.affinityKey = options.affinityKey ?? null;
    this.stub = new Service(
      address,
      options.credentials ?? grpc.credentials.createInsecure(),
      options.channelOptions ?? {},
    );
  }

  close() {
    this.stub.close();
  }

  /** Each call's metadata: the affinity key, if any (a fresh object: grpc-js keeps it). */
  _metadata() {
    const metadata = new grpc.Metadata();
    if (this.affinityKey !== null) metadata.set(AFFINITY_HEADER, this.affinityKey);
    return metadata;
  }

  _unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this._metadata(), deadlineOptions(this.timeoutMs), (err, resp) =>
        err ? reject(new DrafterError(err)) : resolve(resp),
      );
    });
  }

  /** Model shape, limits and live counters (int64 fields as numbers). */
  async getInfo() {
    const info = await this._unary('GetInfo', {});
    info.maxMessageBytes = Number(info.maxMessageBytes);
    return info;
  }

  /**
   * A new, empty state; resolves to its id (a decimal string). `grammar`, if given, is what
   * every draft of the state obeys: one of { jsonSchema }, { ebnf }, { regex } or
   * { structuralTag } (text; a JSON schema or structural tag may be an object), the kinds
   * getInfo().grammarKinds lists. `sampling` ({ temperature, topK, topP, minP, seed }, vLLM's
   * parameters; absent or temperature 0: greedy) draws each draft from q, the head's
   * distribution after them, and the answers then carry q (qIds, qProbs), which accept and
   * acceptBatch take. A draw depends only on (seed, state, position, draft index).
   */
  async allocState(grammar = null, { sampling } = {}) {
    const req = grammar ? { grammar: grammarMessage(grammar) } : {};
    if (sampling) req.sampling = samplingMessage(sampling);
    return (await this._unary('AllocState', req)).stateId;
  }

  /**
   * Appends committed rows (tokens[i], hiddens[i]) at startPosition + i, streamed in
   * chunks of `chunkRows` rows (default: as many as fit in 4 MiB). All or nothing.
   * Resolves to { numRows, nextPosition, chunks }.
   */
  async prefill(stateId, startPosition, tokens, hiddens, { chunkRows } = {}) {
    const rows = tokens.length;
    const [n, width] = hiddens.shape;
    if (hiddens.shape.length !== 2 || n !== rows) {
      throw new RangeError(`hiddens shape [${hiddens.shape}] does not match ${rows} tokens`);
    }
    const rowBytes = width * ITEMSIZE[hiddens.dtype];
    const perChunk = chunkRows ?? Math.max(1, Math.floor((DEFAULT_CHUNK_BYTES - 64) / (rowBytes + 5)));
    return await new Promise((resolve, reject) => {
      let chunks = 0;
      const call = this.stub.Prefill(this._metadata(), deadlineOptions(this.timeoutMs), (err, resp) =>
        err ? reject(new DrafterError(err)) : resolve({ ...parseRows(resp), chunks }),
      );
      for (let lo = 0; lo < Math.max(rows, 1); lo += perChunk) {
        const hi = Math.min(lo + perChunk, rows);
        // The first chunk names the state, the start and the row count (so that a stream
        // cut short is rolled back, never committed); later chunks continue it.
        call.write({
          stateId: lo === 0 ? stateId : '0',
          startPosition: lo === 0 ? startPosition : 0,
          totalRows: lo === 0 ? rows : 0,
          tokens: tokens.slice(lo, hi),
          hiddens: {
            dtype: hiddens.dtype,
            shape: [hi - lo, width],
            data: hiddens.data.subarray(lo * rowBytes, hi * rowBytes),
          },
        });
        chunks++;
      }
      call.end();
    });
  }

  /**
   * Drafts after `token` (its target hidden `hidden`, at position - 1): args are { token,
   * hidden, position, numDrafts } and the options bitmask (int32 tensor), minConfidence,
   * previous: { numAccepted, refeedHiddens } (the fused verdict on the pending proposal),
   * returnBitmasks (for a state with a grammar: its bitmask at each draft's position and the
   * bonus position, as `bitmasks`, an int32 Tensor message [tokens + 1, words]), sampling
   * (the state's from this step on), grammar (the state's from this step's token on, as
   * allocState's; { none: true }: none from this step on; absent: the state keeps its own).
   * Resolves to { stateId, tokens, probs, confidence, firstPosition, bitmasks? }.
   */
  async propose(stateId, args) {
    return parseProposal(await this._unary('Propose', proposeRequest(stateId, args)));
  }

  /**
   * A verifier's whole step for B states in one message, as columns (see Batch): the verdicts
   * on their pending proposals, applied first, and their next proposals, batched with every
   * other Propose call (at most GetInfo.maxBatch rows, each state at most once). A row that
   * fails (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, as propose
   * would) has its DrafterError in the result's `errors`, its field naming the column, and
   * leaves its state unchanged; the other rows are answered. Columns that do not fit together
   * reject the call with INVALID_ARGUMENT and change nothing. A column the wire cannot carry
   * throws before anything is sent. batchOf makes a Batch of states given one by one.
   * @param {Batch} batch
   * @returns {Promise<BatchResult>}
   */
  async proposeBatch(batch) {
    const req = batchRequest(batch);
    return parseBatch(await this._unary('ProposeBatch', req), req);
  }

  /**
   * The hot path: a ProposeStream (see the class), one batch a message and one round trip per
   * verify step. Options: timeoutMs, the deadline of the whole stream (default 0: none, as a
   * stream kept for a verifier's lifetime wants; the client's timeoutMs is not applied). Close
   * it when done.
   * @returns {ProposeStream}
   */
  stream({ timeoutMs = 0 } = {}) {
    return new ProposeStream(this.stub, deadlineOptions(timeoutMs), this._metadata());
  }

  /** The verifier accepted the first numAccepted drafts (refeedHiddens: [a, hidden] or null). */
  async afterVerify(stateId, numAccepted, refeedHiddens = null) {
    const verdict = verdictMessage({ numAccepted, refeedHiddens });
    return parseRows(await this._unary('AfterVerify', { stateId, verdict }));
  }

  /** Detaches the state's KV; resolves to { handleId, numRows, ttlSeconds }. */
  async takeKV(stateId) {
    const r = await this._unary('TakeKV', { stateId });
    return { handleId: r.handleId, numRows: Number(r.numRows), ttlSeconds: r.ttlSeconds };
  }

  /** Installs a handle's KV into an empty state; resolves to { numRows, nextPosition }. */
  async installKV(stateId, handleId) {
    return parseRows(await this._unary('InstallKV', { stateId, handleId }));
  }

  /** Releases the state; resolves to whether it existed. Idempotent. */
  async freeState(stateId) {
    return (await this._unary('FreeState', { stateId })).existed;
  }
}

module.exports = { DrafterClient, DrafterError, ProposeStream, Tensor, accept, acceptBatch, batchOf, loadService };
