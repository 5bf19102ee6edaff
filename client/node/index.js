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
// State and handle ids are uint64: they travel as decimal strings. Tensors are
// { dtype: 'DTYPE_FP32' | 'DTYPE_BF16' | 'DTYPE_FP16' | 'DTYPE_INT32', shape, data: Buffer }
// with data the raw little-endian bytes. A failed call rejects with a DrafterError.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
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

/** A failed RPC: `code` is the gRPC status number, `codeName` its name ("NOT_FOUND"). */
class DrafterError extends Error {
  constructor(err) {
    const codeName = STATUS_NAMES[err.code] ?? 'UNKNOWN';
    super(`${codeName}: ${err.details || err.message}`);
    this.name = 'DrafterError';
    this.code = err.code;
    this.codeName = codeName;
    this.details = err.details;
    this.metadata = err.metadata;
  }
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

  _callOptions() {
    return this.timeoutMs ? { deadline: new Date(Date.now() + this.timeoutMs) } : {};
  }

  _unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this._callOptions(), (err, resp) =>
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
      const call = this.stub.Prefill(this._callOptions(), (err, resp) =>
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
   * Drafts after `token` (its target hidden `hidden`, at position - 1). Options: bitmask
   * (int32 tensor), minConfidence, previous: { numAccepted, refeedHiddens } (the fused
   * verdict on the pending proposal). Resolves to { stateId, tokens, probs, confidence,
   * firstPosition }.
   */
  async propose(stateId, { token, hidden, position, numDrafts, bitmask, minConfidence, previous }) {
    const req = { stateId, token, hidden, position, numDrafts, minConfidence: minConfidence ?? 0 };
    if (bitmask) req.bitmask = bitmask;
    if (previous) req.previous = verdictMessage(previous);
    const p = await this._unary('Propose', req);
    return {
      stateId: p.stateId,
      tokens: p.tokens,
      probs: p.probs,
      confidence: p.confidence,
      firstPosition: Number(p.firstPosition),
    };
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

module.exports = { DrafterClient, DrafterError, Tensor, loadService };
