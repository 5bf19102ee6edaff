'use strict';
// The affinity key rides every call as x-mtpdraft-affinity metadata (a proxy routes by it):
// unary calls, Prefill and the stream, against an in-process fake Drafter.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { DrafterClient, Tensor } = require('../index.js');
const { startFake } = require('./fake_server.js');

const seen = []; // [method, the key the fake saw]
const key = (call) => call.metadata.get('x-mtpdraft-affinity')[0] ?? null;
const fake = {
  AllocState(call, callback) {
    seen.push(['AllocState', key(call)]);
    callback(null, { stateId: '7' });
  },
  Prefill(call, callback) {
    seen.push(['Prefill', key(call)]);
    call.on('data', () => {});
    call.on('end', () => callback(null, { numRows: '1', nextPosition: '2' }));
  },
  ProposeBatch(call, callback) {
    seen.push(['ProposeBatch', key(call)]);
    callback(null, { width: 1, drafts: [1], probs: [1], draftCounts: [1], confidences: [1], firstPositions: ['2'] });
  },
  ProposeStream(call) {
    seen.push(['ProposeStream', key(call)]);
    call.on('data', (req) =>
      call.write({
        requestId: req.requestId, width: 1, drafts: [1], probs: [1], draftCounts: [1], confidences: [1],
        firstPositions: ['2'], errors: [],
      }),
    );
    call.on('end', () => call.end());
  },
};

let server;
let address;

before(async () => {
  ({ server, address } = await startFake(fake));
});

after(() => server.forceShutdown());

async function everyKind(drafter) {
  seen.length = 0;
  const state = await drafter.allocState();
  await drafter.prefill(state, 1, [1], Tensor.fp32([1, 2, 3, 4], [1, 4]));
  const batch = { stateIds: [state], tokens: [1], positions: [2], hiddens: Tensor.fp32([1, 2, 3, 4], [1, 4]), numDrafts: 1 };
  await drafter.proposeBatch(batch);
  const stream = drafter.stream();
  await stream.propose(state, { token: 1, hidden: Tensor.fp32([1, 2, 3, 4]), position: 2, numDrafts: 1 });
  await stream.step(batch);
  stream.close();
  return seen.map(([method, k]) => `${method}=${k}`);
}

test('an affinity key goes with every kind of call', async () => {
  const drafter = new DrafterClient(address, { affinityKey: 'engine-7' });
  try {
    assert.deepEqual(await everyKind(drafter), [
      'AllocState=engine-7', 'Prefill=engine-7', 'ProposeBatch=engine-7', 'ProposeStream=engine-7',
    ]);
  } finally {
    drafter.close();
  }
});

test('without one, no affinity metadata is sent', async () => {
  const drafter = new DrafterClient(address);
  try {
    assert.deepEqual(await everyKind(drafter), [
      'AllocState=null', 'Prefill=null', 'ProposeBatch=null', 'ProposeStream=null',
    ]);
  } finally {
    drafter.close();
  }
});
