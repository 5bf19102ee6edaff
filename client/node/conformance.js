#!/usr/bin/env node
'use strict';
// Replays the conformance vector (tests/conformance/vector.json) against a live server:
//   node conformance.js --address 127.0.0.1:50051 [--vector PATH]
// One line per operation, then "node: N passed, M failed"; exits 1 on any failure, 2 on a
// vector no runner may replay (checked before any call).

const fs = require('node:fs');
const path = require('node:path');
const { DrafterClient, DrafterError, Tensor } = require('./index.js');

function parseArgs(argv) {
  const args = {
    address: process.env.MTPDRAFT_CONFORMANCE_ADDRESS,
    vector: path.resolve(__dirname, '..', '..', 'tests', 'conformance', 'vector.json'),
  };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--address') args.address = argv[++i];
    else if (argv[i] === '--vector') args.vector = argv[++i];
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!args.address) throw new Error('usage: conformance.js --address HOST:PORT [--vector PATH]');
  return args;
}

const FORMAT = 'mtpdraft-conformance/4';
const OPERATIONS = new Set([
  'GetInfo', 'AllocState', 'Prefill', 'Propose', 'ProposeBatch', 'ProposeStream', 'AfterVerify',
  'TakeKV', 'InstallKV', 'FreeState',
]);

// Why no runner may replay the vector, or null if one may.
function vectorFault(v) {
  if (v === null || typeof v !== 'object' || Array.isArray(v)) return 'the vector is not a JSON object';
  if (v.format !== FORMAT) return `format is ${JSON.stringify(v.format)}, not "${FORMAT}"`;
  const tol = v.prob_tolerance;
  if (typeof tol !== 'number' || !(tol >= 0) || !Number.isFinite(tol)) {
    return `prob_tolerance is ${JSON.stringify(tol)}, not a non-negative number`;
  }
  if (!Array.isArray(v.operations) || v.operations.length === 0) return 'operations is missing or empty';
  for (const [i, op] of v.operations.entries()) {
    const name = op !== null && typeof op === 'object' ? op.op : undefined;
    if (!OPERATIONS.has(name)) return `operation ${i}: unknown op ${JSON.stringify(name)}`;
    if (name === 'ProposeStream' && !(Array.isArray(op.messages) && op.messages.length > 0)) {
      return `operation ${i}: ProposeStream without messages`;
    }
    const batches = { ProposeBatch: [op], ProposeStream: op.messages }[name] ?? [];
    for (const batch of batches) {
      if (!(batch && Array.isArray(batch.states) && batch.states.length > 0)) {
        return `operation ${i}: a ${name} batch without states`;
      }
      if (batch.hiddens === null || typeof batch.hiddens !== 'object') {
        return `operation ${i}: a ${name} batch without hiddens`;
      }
    }
  }
  return null;
}

// The vector at `file`, or null after printing why no runner may replay it.
function loadVector(file) {
  let vector;
  try {
    vector = JSON.parse(fs.readFileSync(file, 'utf8'));
  } catch (err) {
    console.error(`node: bad vector: ${err.message}`);
    return null;
  }
  const fault = vectorFault(vector);
  if (fault) {
    console.error(`node: bad vector: ${fault}`);
    return null;
  }
  return vector;
}

function tensor(t) {
  return t ? Tensor.raw(t.dtype, t.shape, Buffer.from(t.data, 'base64')) : null;
}

// A SamplingParams of the vector ({ temperature, top_k, top_p, min_p, seed }) as the client
// takes it (null for none).
function sampling(s) {
  return s ? { temperature: s.temperature, topK: s.top_k, topP: s.top_p, minP: s.min_p, seed: s.seed } : null;
}

// The client's propose arguments for a Propose operation.
function proposeArgs(op) {
  const prev = op.previous;
  return {
    token: op.token,
    hidden: tensor(op.hidden),
    position: op.position,
    numDrafts: op.num_drafts,
    bitmask: tensor(op.bitmask),
    minConfidence: op.min_confidence,
    previous: prev && { numAccepted: prev.num_accepted, refeedHiddens: tensor(prev.refeed_hiddens) },
    sampling: sampling(op.sampling),
    grammar: op.grammar && grammarOf(op.grammar),
    draftCap: op.draft_cap,
    verifyTokenCost: op.verify_token_cost,
  };
}

// A list of the vector as a typed array of `Type`, unless that would change a value (then, and
// for anything but a list, as it is: the client refuses what the wire cannot carry).
function typed(Type, values) {
  if (!Array.isArray(values)) return values;
  const out = Type.from(values);
  return out.every((x, i) => x === values[i]) ? out : values;
}

// The client's Batch for a batch (a ProposeBatch operation or a ProposeStream message): its state
// names' ids, the number columns as typed arrays (as a verifier holds them), optional columns
// only where given.
function batchArgs(op, stateId) {
  return {
    stateIds: op.states.map(stateId),
    tokens: typed(Int32Array, op.tokens),
    positions: typed(Float64Array, op.positions),
    hiddens: tensor(op.hiddens),
    numDrafts: typed(Int32Array, op.num_drafts),
    numAccepted: typed(Int32Array, op.num_accepted),
    refeedRows: typed(Int32Array, op.refeed_rows),
    refeedHiddens: tensor(op.refeed_hiddens),
    bitmaskRows: typed(Int32Array, op.bitmask_rows),
    bitmasks: tensor(op.bitmasks),
    minConfidence: op.min_confidence,
    samplingRows: typed(Int32Array, op.sampling_rows),
    sampling: op.sampling?.map(sampling),
    grammarRows: typed(Int32Array, op.grammar_rows),
    grammars: op.grammars?.map(grammarOf),
    draftCaps: typed(Int32Array, op.draft_caps),
    verifyTokenCosts: op.verify_token_costs,
  };
}

// A BatchResult's outputs, named as in the vector: [B][width] drafts and probs, each column as
// a list, the failed rows' errors in row order.
function batchOutputs(r) {
  const rows = (flat) => Array.from(r.counts, (_, i) => Array.from(flat.subarray(i * r.width, (i + 1) * r.width)));
  return {
    width: r.width,
    drafts: rows(r.drafts),
    probs: rows(r.probs),
    draft_counts: Array.from(r.counts),
    confidences: Array.from(r.confidences),
    first_positions: Array.from(r.firstPositions),
    errors: [...r.errors.entries()].sort(([a], [b]) => a - b).map(([row, e]) => ({
      row,
      code: e.codeName,
      reason: e.reason ?? '',
      field: e.field ?? '',
    })),
    q_support: r.qSupport,
    q_ids: qRows(r, r.qIds),
    q_probs: qRows(r, r.qProbs),
  };
}

// A batch's q column as [B][width][support] lists.
function qRows(r, flat) {
  const s = r.qSupport;
  if (!s) return [];
  return Array.from(r.counts, (_, i) =>
    Array.from({ length: r.width }, (_, j) => Array.from(flat.subarray((i * r.width + j) * s, (i * r.width + j + 1) * s))));
}

// A Proposal's outputs, named as in the vector; it must be the state's.
function proposalOutputs(p, state) {
  if (p.stateId !== state) throw new Error(`Proposal.state_id ${p.stateId} != state ${state}`);
  return {
    tokens: p.tokens,
    probs: p.probs,
    confidence: p.confidence,
    first_position: p.firstPosition,
    q_support: p.qSupport ?? 0,
    q_ids: p.qIds ?? [],
    q_probs: p.qProbs ?? [],
  };
}

const FLOAT_KEYS = new Set(['probs', 'confidence', 'confidences', 'q_probs']);

// Whether `got` is `want` within `tol`, number by number (nested lists alike).
function close(want, got, tol) {
  if (Array.isArray(want)) {
    return Array.isArray(got) && want.length === got.length && want.every((w, i) => close(w, got[i], tol));
  }
  return typeof want === 'number' && Number.isFinite(got) && Math.abs(got - want) <= tol;
}

// A row error as the vector lists it, with no field (or reason) the same as an empty one.
function rowErrorText(e) {
  return e && typeof e === 'object' ? `${e.row} ${errorText(e.code, e.reason || '', e.field || '')}` : String(e);
}

// The fields of `expected` that `actual` does not match; with one_of (the answers a sampled
// draft may give), none where `actual` matches one of them.
function mismatches(expected, actual, tol) {
  if (expected.one_of) {
    const tries = expected.one_of.map((answer) => mismatches(answer, actual, tol));
    return tries.some((bad) => bad.length === 0) ? [] : [`none of ${tries.length} answers: ${tries[0].join('; ')}`];
  }
  const out = [];
  for (const [key, want] of Object.entries(expected)) {
    const got = actual[key];
    let same;
    if (FLOAT_KEYS.has(key)) {
      same = close(want, got, tol);
    } else if (key === 'errors') {
      same = Array.isArray(want) && JSON.stringify(want.map(rowErrorText)) === JSON.stringify(got.map(rowErrorText));
    } else {
      same = JSON.stringify(got) === JSON.stringify(want);
    }
    if (!same) out.push(`${key}: expected ${JSON.stringify(want)}, got ${JSON.stringify(got)}`);
  }
  return out;
}

class Replayer {
  constructor(client, tolerance) {
    this.client = client;
    this.tolerance = tolerance;
    this.states = new Map();
    this.handles = new Map();
  }

  // The id bound to a state name (0, which no state has, for a name never bound).
  stateId(name) {
    return this.states.get(name) ?? '0';
  }

  nonZero(id, what) {
    if (!id || id === '0') throw new Error(`${what} returned id 0`);
    return id;
  }

  // The operation's outputs, named as in the vector.
  async call(op) {
    const c = this.client;
    if (op.op === 'GetInfo') {
      const info = await c.getInfo();
      const out = {};
      for (const key of Object.keys(op.expect ?? {})) {
        out[key] = info[key.replace(/_([a-z])/g, (_, ch) => ch.toUpperCase())];
      }
      return out;
    }
    if (op.op === 'AllocState') {
      const grammar = op.grammar ? grammarOf(op.grammar) : null;
      const state = await c.allocState(grammar, { sampling: sampling(op.sampling) });
      this.states.set(op.state, this.nonZero(state, 'AllocState'));
      return {};
    }
    if (op.op === 'ProposeBatch') {
      return batchOutputs(await c.proposeBatch(batchArgs(op, (name) => this.stateId(name))));
    }
    const state = this.states.get(op.state);
    switch (op.op) {
      case 'Prefill': {
        const r = await c.prefill(state, op.start_position, op.tokens, tensor(op.hiddens), {
          chunkRows: op.chunk_rows,
        });
        return { num_rows: r.numRows, next_position: r.nextPosition, chunks: r.chunks };
      }
      case 'Propose':
        return proposalOutputs(await c.propose(state, proposeArgs(op)), state);
      case 'AfterVerify': {
        const r = await c.afterVerify(state, op.num_accepted, tensor(op.refeed_hiddens));
        return { num_rows: r.numRows, next_position: r.nextPosition };
      }
      case 'TakeKV': {
        const h = await c.takeKV(state);
        this.handles.set(op.handle, this.nonZero(h.handleId, 'TakeKV'));
        return { num_rows: h.numRows };
      }
      case 'InstallKV': {
        const r = await c.installKV(state, this.handles.get(op.handle));
        return { num_rows: r.numRows, next_position: r.nextPosition };
      }
      case 'FreeState':
        return { existed: await c.freeState(state) };
      default:
        throw new Error(`unknown operation ${op.op}`);
    }
  }

  // [ok, message] for one operation.
  async step(op) {
    if (op.op === 'ProposeStream') return await this.streamStep(op);
    return await this.judge(op, () => this.call(op));
  }

  // One stream, its messages sent one at a time, each answered before the next; ok when every
  // answer is as expected. An error answer leaves the stream open for the next message.
  async streamStep(op) {
    const stream = this.client.stream();
    const results = [];
    try {
      for (const msg of op.messages) {
        const send = async () => batchOutputs(await stream.step(batchArgs(msg, (name) => this.stateId(name))));
        results.push(await this.judge(msg, send));
      }
    } finally {
      await stream.close();
    }
    const ok = results.every(([good]) => good);
    return [ok, results.map(([, text], j) => `[${j}] ${text}`).join('; ')];
  }

  // [ok, message]: runs `call` and compares its outputs (or its error) with what `op` expects.
  async judge(op, call) {
    let actual;
    try {
      actual = await call();
    } catch (err) {
      if (!(err instanceof DrafterError)) return [false, `error: ${err.message}`];
      const got = errorText(err.codeName, err.reason, err.field);
      const want = op.expect_error
        ? errorText(op.expect_error, op.expect_reason, op.expect_field)
        : 'success';
      if (got === want) return [true, `${got} as expected`];
      return [false, `expected ${want}, got ${got}: ${err.message}`];
    }
    if (op.expect_error) return [false, `expected ${op.expect_error}, got ${JSON.stringify(actual)}`];
    const bad = mismatches(op.expect ?? {}, actual, this.tolerance);
    return bad.length ? [false, bad.join('; ')] : [true, JSON.stringify(actual)];
  }
}

// An error as every runner prints it: "CODE (reason R, field F)".
function errorText(code, reason, field) {
  return `${code} (reason ${reason ?? ''}, field ${field ?? ''})`;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const vector = loadVector(args.vector);
  if (!vector) return 2;
  const client = new DrafterClient(args.address, { timeoutMs: 30000 });
  const replayer = new Replayer(client, vector.prob_tolerance);
  let passed = 0;
  let failed = 0;
  try {
    for (const [i, op] of vector.operations.entries()) {
      const [ok, message] = await replayer.step(op);
      ok ? passed++ : failed++;
      let label = op.state ? `${op.op} ${op.state}` : op.op;
      if (op.messages) label += ` (${op.messages.length} messages)`;
      if (op.states) label += ` (${op.states.join(', ')})`;
      console.log(`${ok ? 'ok  ' : 'FAIL'} ${String(i).padStart(2, '0')} ${label}: ${message}`);
    }
  } finally {
    for (const state of replayer.states.values()) await client.freeState(state).catch(() => {});
    client.close();
  }
  console.log(`node: ${passed} passed, ${failed} failed`);
  return failed === 0 && passed === vector.operations.length ? 0 : 1;
}

main().then(
  (code) => process.exit(code),
  (err) => {
    console.error(`node: ${err.stack || err}`);
    process.exit(2);
  },
);

// A grammar of the vector, { kind: source } with the wire's snake_case kind (or { none: true }),
// in the client's camelCase.
function grammarOf(grammar) {
  return Object.fromEntries(
    Object.entries(grammar).map(([kind, source]) => [
      kind.replace(/_([a-z])/g, (_, c) => c.toUpperCase()),
      source,
    ]),
  );
}
