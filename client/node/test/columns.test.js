'use strict';
// The client's columnar calls against an in-process fake Drafter (no model): what goes on the
// wire, how answers come back as typed arrays, and a ProposeColumnsStream's matching of answers
// to steps by request id. Run with `npm test` in client/node.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const grpc = require('@grpc/grpc-js');
const { DrafterClient, DrafterError, Tensor } = require('../index.js');
const { startFake } = require('./fake_server.js');

const HIDDEN = 4;
const requests = []; // every ColumnsRequest and ProposeBatchRequest the fake received

// A ColumnsResponse for `req`: row i drafts K_i tokens 100 * i + j at probs 0.5, except a
// state id 0, whose row fails with NOT_FOUND naming state_ids.
function answer(req) {
  const size = req.stateIds.length;
  const ks = req.numDrafts.length === 1 ? Array(size).fill(req.numDrafts[0]) : req.numDrafts;
  const width = Math.max(...req.numDrafts);
  const resp = {
    requestId: req.requestId, width, drafts: [], probs: [], draftCounts: [], confidences: [],
    firstPositions: [], errors: [],
  };
  for (let i = 0; i < size; i++) {
    const failed = req.stateIds[i] === '0';
    const n = failed ? 0 : ks[i];
    for (let j = 0; j < width; j++) {
      resp.drafts.push(j < n ? 100 * i + j : -1);
      resp.probs.push(j < n ? 0.5 : 0);
    }
    resp.draftCounts.push(n);
    resp.confidences.push(n ? 0.5 : 0);
    resp.firstPositions.push(failed ? '0' : String(BigInt(req.positions[i]) + 1n));
    if (failed) {
      resp.errors.push({
        row: i,
        error: { code: grpc.status.NOT_FOUND, message: 'no such state', reason: 'STATE_NOT_FOUND', field: 'state_ids' },
      });
    }
  }
  return resp;
}

// Why `req` fails as a whole, as an Error value, or null.
function misfit(req) {
  if (req.tokens.length !== req.stateIds.length) {
    return { code: grpc.status.INVALID_ARGUMENT, message: 'tokens', reason: 'COLUMNS_MISMATCH', field: 'tokens' };
  }
  return null;
}

const fake = {
  ProposeColumns(call, callback) {
    requests.push(call.request);
    const fault = misfit(call.request);
    if (fault) callback({ code: fault.code, details: fault.message });
    else callback(null, answer(call.request));
  },
  // Holds each step until the next arrives and answers the later one first (out of order),
  // a lone last step on the end of the requests.
  ProposeColumnsStream(call) {
    let held = null;
    const reply = (req) => {
      const fault = misfit(req);
      call.write(fault ? { requestId: req.requestId, error: fault } : answer(req));
    };
    call.on('data', (req) => {
      requests.push(req);
      if (held) {
        reply(req);
        reply(held);
        held = null;
      } else {
        held = req;
      }
    });
    call.on('end', () => {
      if (held) reply(held);
      call.end();
    });
  },
  ProposeBatch(call, callback) {
    requests.push(call.request);
    callback(null, {
      proposals: call.request.requests.map((r) => ({
        stateId: r.stateId, tokens: [r.token], probs: [0.25], confidence: 0.25,
        firstPosition: String(Number(r.position) + 1),
      })),
    });
  },
};

let server;
let drafter;

before(async () => {
  let address;
  ({ server, address } = await startFake(fake));
  drafter = new DrafterClient(address, { timeoutMs: 10000 });
});

after(() => {
  drafter.close();
  server.forceShutdown();
});

function hiddens(rows) {
  return Tensor.fp32(new Float32Array(rows * HIDDEN).fill(0.5), [rows, HIDDEN]);
}

test('proposeColumns sends the columns and answers as typed arrays, failed rows in errors', async () => {
  const got = await drafter.proposeColumns({
    stateIds: BigUint64Array.of(18446744073709551615n, 0n, 7n),
    tokens: Int32Array.of(1, 2, -3),
    positions: BigInt64Array.of(9007199254740993n, 5n, 6n),
    hiddens: hiddens(3),
    numDrafts: Int32Array.of(2, 3, 1),
    numAccepted: Int32Array.of(-1, 0, 2),
    minConfidence: 0.25,
  });
  const req = requests.at(-1);
  assert.deepEqual(req.stateIds, ['18446744073709551615', '0', '7']);
  assert.deepEqual(req.tokens, [1, 2, -3]);
  assert.deepEqual(req.positions, ['9007199254740993', '5', '6']);
  assert.deepEqual(req.numAccepted, [-1, 0, 2]);
  assert.deepEqual(req.minConfidence, [0.25]);
  assert.deepEqual(req.refeedRows, []); // left out: sent empty, "none"
  assert.equal(req.refeedHiddens, null);
  assert.deepEqual(req.hiddens.shape, ['3', String(HIDDEN)]);

  assert.equal(got.width, 3);
  assert.ok(got.drafts instanceof Int32Array && got.probs instanceof Float32Array);
  assert.deepEqual(Array.from(got.drafts), [0, 1, -1, -1, -1, -1, 200, -1, -1]);
  assert.deepEqual(Array.from(got.probs), [0.5, 0.5, 0, 0, 0, 0, 0.5, 0, 0]);
  assert.deepEqual(got.counts, Int32Array.of(2, 0, 1));
  assert.deepEqual(got.confidences, Float32Array.of(0.5, 0, 0.5));
  assert.deepEqual(got.firstPositions, Float64Array.of(9007199254740994, 0, 7));
  assert.deepEqual([...got.errors.keys()], [1]);
  const err = got.errors.get(1);
  assert.ok(err instanceof DrafterError);
  assert.equal(err.codeName, 'NOT_FOUND');
  assert.equal(err.reason, 'STATE_NOT_FOUND');
  assert.equal(err.field, 'state_ids');
});

test('proposeColumns takes plain arrays, decimal ids, one K for all, refeeds and bitmasks', async () => {
  const got = await drafter.proposeColumns({
    stateIds: ['5', 6],
    tokens: [1, 2],
    positions: [3, 4],
    hiddens: hiddens(2),
    numDrafts: 2,
    numAccepted: [1, -1],
    refeedRows: [1, 0],
    refeedHiddens: hiddens(1),
    bitmaskRows: [0, 1],
    bitmasks: Tensor.int32(Int32Array.of(-1, 7), [1, 2]),
  });
  const req = requests.at(-1);
  assert.deepEqual(req.stateIds, ['5', '6']);
  assert.deepEqual(req.numDrafts, [2]);
  assert.deepEqual(req.refeedRows, [1, 0]);
  assert.deepEqual(req.refeedHiddens.shape, ['1', String(HIDDEN)]);
  assert.deepEqual(req.bitmaskRows, [0, 1]);
  assert.deepEqual(req.bitmasks.data, Buffer.from([255, 255, 255, 255, 7, 0, 0, 0]));
  assert.deepEqual(got.counts, Int32Array.of(2, 2));
  assert.equal(got.errors.size, 0);
});

test('proposeColumns refuses, before sending, a value its column cannot carry', async () => {
  const sent = requests.length;
  const base = { stateIds: [1], tokens: [1], positions: [1], hiddens: hiddens(1), numDrafts: [1] };
  for (const [name, value] of [
    ['tokens', [1.5]],
    ['tokens', [2 ** 31]],
    ['stateIds', [-1]],
    ['stateIds', ['18446744073709551616']],
    ['positions', [2 ** 53]],
    ['numDrafts', '3'],
    ['minConfidence', ['0.5']],
  ]) {
    await assert.rejects(drafter.proposeColumns({ ...base, [name]: value }), (err) => {
      assert.ok(err instanceof RangeError || err instanceof TypeError, String(err));
      assert.match(err.message, new RegExp(`^${name}`));
      return true;
    });
  }
  assert.equal(requests.length, sent);
});

test('a whole-message failure rejects the unary call with its status', async () => {
  await assert.rejects(
    drafter.proposeColumns({ stateIds: [1, 2], tokens: [1], positions: [1, 2], hiddens: hiddens(2), numDrafts: 1 }),
    (err) => err instanceof DrafterError && err.codeName === 'INVALID_ARGUMENT',
  );
});

test('columnsStream matches answers to steps by request id; a failed step leaves it open', async () => {
  const stream = drafter.columnsStream();
  const step = (ids, extra = {}) =>
    stream.step({
      stateIds: ids, tokens: ids.map(() => 1), positions: ids.map((_, i) => 10 * (i + 1)),
      hiddens: hiddens(ids.length), numDrafts: 1, ...extra,
    });
  // The fake answers the second of each pair first.
  const [a, b] = await Promise.all([step([1]), step([1, 2, 3])]);
  assert.deepEqual(a.counts, Int32Array.of(1));
  assert.deepEqual(b.firstPositions, Float64Array.of(11, 21, 31));
  const [bad, good] = await Promise.allSettled([step([1, 2], { tokens: [1] }), step([0, 4])]);
  assert.equal(bad.status, 'rejected');
  assert.ok(bad.reason instanceof DrafterError);
  assert.equal(bad.reason.codeName, 'INVALID_ARGUMENT');
  assert.equal(bad.reason.reason, 'COLUMNS_MISMATCH');
  assert.equal(bad.reason.field, 'tokens');
  assert.equal(good.status, 'fulfilled');
  assert.equal(good.value.errors.get(0).codeName, 'NOT_FOUND');
  const last = step([9]); // held by the fake until the requests end
  await stream.close();
  assert.deepEqual((await last).counts, Int32Array.of(1));
  await assert.rejects(step([1]), (err) => err instanceof DrafterError && err.codeName === 'UNAVAILABLE');
});

test('proposeBatch sends the requests in order and answers their proposals', async () => {
  assert.deepEqual(await drafter.proposeBatch([]), []);
  const got = await drafter.proposeBatch([
    { stateId: '3', token: 7, hidden: Tensor.fp32([1, 2, 3, 4]), position: 5, numDrafts: 2, previous: { numAccepted: 1 } },
    { stateId: '4', token: 8, hidden: Tensor.fp32([1, 2, 3, 4]), position: 9, numDrafts: 1, minConfidence: 0.5 },
  ]);
  const req = requests.at(-1);
  assert.deepEqual(req.requests.map((r) => [r.stateId, r.token, r.numDrafts]), [['3', 7, 2], ['4', 8, 1]]);
  assert.equal(req.requests[0].previous.numAccepted, 1);
  assert.equal(req.requests[1].minConfidence, 0.5);
  assert.deepEqual(got.map((p) => [p.stateId, p.tokens, p.firstPosition]), [['3', [7], 6], ['4', [8], 10]]);
});

test('Tensor.fp32 and Tensor.int32 write the same bytes from typed arrays and from numbers', () => {
  const values = [0.1, -2.5, 3e38, -0];
  assert.deepEqual(Tensor.fp32(Float32Array.from(values)).data, Tensor.fp32(values).data);
  const view = new Float32Array(new Float32Array([9, ...values]).buffer, 4, 4); // an offset view
  assert.deepEqual(Tensor.fp32(view, [2, 2]), Tensor.fp32(values, [2, 2]));
  assert.deepEqual(Tensor.int32(Int32Array.of(-1, 5)).data, Tensor.int32([-1, 5]).data);
});
