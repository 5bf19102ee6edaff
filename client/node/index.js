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
// The hot path is one round trip per verify step: a ProposeStream, each message carrying the
// verdict on the state's last proposal (`previous`) and the next proposal's inputs. One stream
// serves many states, with many requests in flight; each answer settles its own promise.
//
//   const stream = drafter.stream({ timeoutMs: 0 }); // lives as long as the verifier
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
// stream message that the server refused (the stream stays open).

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protobuf = require('protobufjs');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILE = 'mtpdraft/v1/drafter.proto';
const DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024;
const ITEMSIZE = { DTYPE_BF16: 2, DTYPE_FP16: 2, DTYPE_FP32: 4, DTYPE_INT32: 4 };
const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

let cachedService = null;

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
 * A failed RPC, or a ProposeStream message the server refused: `code` is the gRPC status
 * number, `codeName` its name ("NOT_FOUND"), `reason` the machine-readable reason
 * (google.rpc.ErrorInfo) and `field` the offending request field (google.rpc.BadRequest),
 * each null when the server sent none. `metadata` is the trailers of a failed call (undefined
 * for a stream message's error).
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

// The DrafterError of an Error carried as a value (a ProposeStream answer).
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
    const data = Buffer.alloc(values.length * 4);
    for (let i = 0; i < values.length; i++) data.writeFloatLE(values[i], i * 4);
    return Tensor.raw('DTYPE_FP32', shape ?? [values.length], data);
  },
  /** An int32 tensor (e.g. an xgrammar bitmask, shape [words] or [rows, words]). */
  int32(values, shape) {
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

function verdictMessage(previous) {
  const msg = { numAccepted: previous.numAccepted };
  if (previous.refeedHiddens) msg.refeedHiddens = previous.refeedHiddens;
  return msg;
}

function parseRows(resp) {
  return { numRows: Number(resp.numRows), nextPosition: Number(resp.nextPosition) };
}

// The ProposeRequest of propose's arguments (unary and stream alike).
function proposeRequest(stateId, { token, hidden, position, numDrafts, bitmask, minConfidence, previous }) {
  const req = { stateId, token, hidden, position, numDrafts, minConfidence: minConfidence ?? 0 };
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
  };
}

function deadlineOptions(timeoutMs) {
  return timeoutMs ? { deadline: new Date(Date.now() + timeoutMs) } : {};
}

/**
 * The hot path: one ProposeStream call, one message and one answer per verify step (made by
 * DrafterClient.stream()). Many states may share it and many requests may be in flight: answers
 * come as they are ready, possibly out of order, and settle their own promise by request id. A
 * message the server refuses rejects its promise with a DrafterError and leaves the stream open;
 * once the stream ends (close(), its deadline, a server or network failure) every pending and
 * later propose rejects.
 */
class ProposeStream {
  constructor(stub, callOptions) {
    this._pending = new Map(); // request id (a decimal string, as answers carry it) -> promise settlers
    this._nextId = 1; // not 0: the proto default must not match a request
    this._ended = false; // true once close() ran or the call failed or ended: no more writes
    this._failure = null; // the call's DrafterError, if it failed
    this._call = stub.ProposeStream(callOptions);
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
    if (resp.proposal) pending.resolve(parseProposal(resp.proposal));
    else pending.reject(errorFromValue(resp.error ?? { code: grpc.status.UNKNOWN, message: 'empty answer' }));
  }

  /**
   * One verify step's round trip: the arguments of DrafterClient.propose (usually with
   * `previous` set). Resolves to the Proposal; rejects with a DrafterError.
   *
   * A request that the serializer rejects (an argument of the wrong JavaScript type) makes
   * grpc-js cancel the whole call with INTERNAL, failing the other requests in flight too.
   */
  async propose(stateId, args) {
    if (this._ended) throw this._failure ?? streamClosedError();
    const req = proposeRequest(stateId, args);
    req.requestId = String(this._nextId++);
    return await new Promise((resolve, reject) => {
      this._pending.set(req.requestId, { resolve, reject });
      // No wait on backpressure: grpc-js buffers, and what is in flight is bounded by the
      // caller's pending promises.
      this._call.write(req);
    });
  }

  /**
   * Ends the writing side; resolves once the server has answered the requests in flight and
   * finished the call (at once if it already has). Never rejects: a failure of the call has
   * already rejected the promises it concerns.
   */
  async close() {
    if (!this._ended) {
      this._ended = true;
      this._call.end();
    }
    await this._finished;
  }
}

class DrafterClient {
  /**
   * @param {string} address host:port of the server
   * @param {object} [options] timeoutMs: default deadline of every call (0: none);
   *   credentials (default insecure); channelOptions; protoRoot (folder holding mtpdraft/v1/).
   */
  constructor(address, options = {}) {
    const Service = loadService(options.protoRoot);
    this.timeoutMs = options.timeoutMs ?? 30000;
    this.stub = new Service(
      address,
      options.credentials ?? grpc.credentials.createInsecure(),
      options.channelOptions ?? {},
    );
  }

  close() {
    this.stub.close();
  }

  _unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, deadlineOptions(this.timeoutMs), (err, resp) =>
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

  /** A new, empty state; resolves to its id (a decimal string). */
  async allocState() {
    return (await this._unary('AllocState', {})).stateId;
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
      const call = this.stub.Prefill(deadlineOptions(this.timeoutMs), (err, resp) =>
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
   * previous: { numAccepted, refeedHiddens } (the fused verdict on the pending proposal).
   * Resolves to { stateId, tokens, probs, confidence, firstPosition }.
   */
  async propose(stateId, args) {
    return parseProposal(await this._unary('Propose', proposeRequest(stateId, args)));
  }

  /**
   * The hot path: a ProposeStream (see the class) for proposals with `previous` set, one round
   * trip per verify step. Options: timeoutMs, the deadline of the whole stream (default the
   * client's; 0: none, as a stream kept for a verifier's lifetime wants). Close it when done.
   */
  stream({ timeoutMs = this.timeoutMs } = {}) {
    return new ProposeStream(this.stub, deadlineOptions(timeoutMs));
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

module.exports = { DrafterClient, DrafterError, ProposeStream, Tensor, loadService };
