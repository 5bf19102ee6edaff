'use strict';
// The client's batch calls against an in-process fake Drafter (no model): what goes on the wire,
// how answers come back as typed arrays, batchOf's columns of states given one by one, and a
// ProposeStream's matching of answers to messages by request id. Run with `npm test` in
// client/node.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const grpc = require('@grpc/grpc-js');
const { DrafterClient, DrafterError, Tensor, batchOf } = require('../index.js');
const { startFake } = require('./fake_server.js');

const HIDDEN = 4;
const requests = []; // every ProposeBatchRequest the fake received

// A ProposeBatchResponse for `req`: row i drafts K_i tokens 100 * i + j at probs 0.5, except a
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
  Propose(call, callback) {
    requests.push(call.request);
    const req = call.request;
    callback(null, { stateId: req.stateId, tokens: [4], probs: [0.5], confidence: 0.5, firstPosition: '10' });
  },
  ProposeBatch(call, callback) {
    requests.push(call.request);
    const fault = misfit(call.request);
    if (fault) callback({ code: fault.code, details: fault.message });
    else callback(null, answer(call.request));
  },
  // Holds each message until the next arrives and answers the later one first (out of order),
  // a lone last message on the end of the requests.
  ProposeStream(call) {
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

test('proposeBatch sends the columns and answers as typed arrays, failed rows in errors', async () => {
  const got = await drafter.proposeBatch({
    stateIds: BigUint64Array.of(18446744073709551615n, 0n, 7n),
    tokens: Int32Array.of(1, 2, -3),
    positions: BigInt64Array.of(9007199254740993n, 5n, 6n),
    hiddens: hiddens(3),
    numDrafts: Int32Array.of(2, 3, 1),
    numAccepted: Int32Array.of(-1, 0, 2),
    minConfidence: 0.25,
    stepNumbers: 18446744073709551615n,
  });
  const req = requests.at(-1);
  assert.deepEqual(req.stepNumbers, ['18446744073709551615']);
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
  assert.deepEqual(got.stateIds, ['18446744073709551615', '0', '7']);
  assert.deepEqual(got.proposal(2), {
    stateId: '7', tokens: [200], probs: [0.5], confidence: 0.5, firstPosition: 7,
  });
  assert.throws(() => got.proposal(1), (e) => e === err);
});

test('proposeBatch takes plain arrays, decimal ids, one K for all, refeeds and bitmasks', async () => {
  const got = await drafter.proposeBatch({
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

test('proposeBatch refuses, before sending, a value its column cannot carry', async () => {
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
    await assert.rejects(drafter.proposeBatch({ ...base, [name]: value }), (err) => {
      assert.ok(err instanceof RangeError || err instanceof TypeError, String(err));
      assert.match(err.message, new RegExp(`^${name}`));
      return true;
    });
  }
  assert.equal(requests.length, sent);
});

test('a whole-message failure rejects the unary call with its status', async () => {
  await assert.rejects(
    drafter.proposeBatch({ stateIds: [1, 2], tokens: [1], positions: [1, 2], hiddens: hiddens(2), numDrafts: 1 }),
    (err) => err instanceof DrafterError && err.codeName === 'INVALID_ARGUMENT',
  );
});

test('stream matches answers to messages by request id; a failed message leaves it open', async () => {
  const stream = drafter.stream();
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

test('batchOf makes the columns of states given one by one', () => {
  const refeed = Tensor.fp32([7, 8, 9, 10, 11, 12, 13, 14], [2, HIDDEN]);
  const batch = batchOf([
    { stateId: '3', token: 13, hidden: Tensor.fp32([1, 2, 3, 4]), position: 5, numDrafts: 2,
      previous: { numAccepted: 2, refeedHiddens: refeed } },
    { stateId: 1n, token: 11, hidden: hiddens(1), position: 6, numDrafts: 3,
      bitmask: Tensor.int32([5]) },
    { stateId: 8, token: 1, hidden: Tensor.fp32([5, 6, 7, 8]), position: 2, numDrafts: 4,
      bitmask: Tensor.int32([-1, -1, 3, 4], [2, 2]), minConfidence: 0.5, previous: { numAccepted: 1 },
      stepNumber: 9 },
  ]);
  assert.deepEqual(batch.stepNumbers, [0, 0, 9]);
  assert.deepEqual(batch.stateIds, ['3', 1n, 8]);
  assert.deepEqual(batch.tokens, [13, 11, 1]);
  assert.deepEqual(batch.numDrafts, [2, 3, 4]);
  assert.deepEqual(batch.hiddens, Tensor.fp32([1, 2, 3, 4, 0.5, 0.5, 0.5, 0.5, 5, 6, 7, 8], [3, HIDDEN]));
  assert.deepEqual(batch.numAccepted, [2, -1, 1]);
  assert.deepEqual(batch.refeedRows, [2, 0, 0]);
  assert.deepEqual(batch.refeedHiddens, refeed);
  assert.deepEqual(batch.bitmaskRows, [0, 1, 2]);
  assert.deepEqual(batch.bitmasks, Tensor.int32([5, 0, -1, -1, 3, 4], [3, 2])); // padded with 0
  assert.deepEqual(batch.minConfidence, [0, 0, 0.5]);
  const plain = batchOf([{ stateId: '3', token: 1, hidden: hiddens(1), position: 5, numDrafts: 1 }]);
  assert.deepEqual(Object.keys(plain), ['stateIds', 'tokens', 'positions', 'hiddens', 'numDrafts']);
  assert.throws(() => batchOf([{ stateId: '3', hidden: hiddens(2) }]), RangeError); // one row each
  assert.throws(
    () => batchOf([{ stateId: '3', hidden: hiddens(1) }, { stateId: '4', hidden: Tensor.fp32([1, 2]) }]),
    RangeError,
  );
});

test('stream.propose sends one state as a batch of one and answers its Proposal', async () => {
  const stream = drafter.stream();
  const hidden = Tensor.fp32([1, 2, 3, 4]);
  const sent = requests.length;
  // The fake answers a pair of messages: one state's, and one of a state it does not know.
  const [p, gone] = await Promise.allSettled([
    stream.propose('5', { token: 1, hidden, position: 9, numDrafts: 2, previous: { numAccepted: 0 } }),
    stream.propose('0', { token: 1, hidden, position: 9, numDrafts: 2 }),
  ]);
  const req = requests[sent];
  assert.deepEqual([req.stateIds, req.numDrafts, req.numAccepted], [['5'], [2], [0]]);
  assert.deepEqual(req.hiddens.shape, ['1', String(HIDDEN)]);
  assert.deepEqual(p.value, { stateId: '5', tokens: [0, 1], probs: [0.5, 0.5], confidence: 0.5, firstPosition: 10 });
  assert.ok(gone.reason instanceof DrafterError);
  assert.deepEqual([gone.reason.reason, gone.reason.field], ['STATE_NOT_FOUND', 'state_ids']);
  await stream.close();
});

test('propose and the batches carry step numbers, which make a resent step safe', async () => {
  const hidden = Tensor.fp32([1, 2, 3, 4]);
  await drafter.propose('5', { token: 1, hidden, position: 9, numDrafts: 1, stepNumber: 12 });
  assert.equal(requests.at(-1).stepNumber, '12');
  await drafter.propose('5', { token: 1, hidden, position: 9, numDrafts: 1 });
  assert.equal(requests.at(-1).stepNumber, '0'); // not numbered
  await drafter.proposeBatch(batchOf([{ stateId: '5', token: 1, hidden, position: 9, numDrafts: 1, stepNumber: 3n }]));
  assert.deepEqual(requests.at(-1).stepNumbers, ['3']);
  await assert.rejects(
    drafter.proposeBatch({ stateIds: ['5'], tokens: [1], positions: [9], hiddens: hiddens(1), numDrafts: 1, stepNumbers: [-1] }),
    RangeError,
  );
});

test('Tensor.fp32 and Tensor.int32 write the same bytes from typed arrays and from numbers', () => {
  const values = [0.1, -2.5, 3e38, -0];
  assert.deepEqual(Tensor.fp32(Float32Array.from(values)).data, Tensor.fp32(values).data);
  const view = new Float32Array(new Float32Array([9, ...values]).buffer, 4, 4); // an offset view
  assert.deepEqual(Tensor.fp32(view, [2, 2]), Tensor.fp32(values, [2, 2]));
  assert.deepEqual(Tensor.int32(Int32Array.of(-1, 5)).data, Tensor.int32([-1, 5]).data);
});
