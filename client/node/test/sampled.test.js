'use strict';
// Sampled drafts and the drafter's own K: sampling parameters and draft caps on the wire
// (allocState, propose, a batch's columns, batchOf), q read back from the answers, and an
// answer taken by acceptBatch as it is.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { DrafterClient, Tensor, acceptBatch, batchOf } = require('../index.js');
const { startFake } = require('./fake_server.js');

const requests = [];
// The worked example of accept.test.js as an answer's columns: row 0 sampled (two drafts), row
// 1 one draft; q is [B, width, support], zeros past a row's count.
const SAMPLED = {
  width: 2,
  drafts: [1, 2, 0, -1],
  probs: [0.5, 1, 0.6, 0],
  draftCounts: [2, 1],
  confidences: [0.5, 0.6],
  firstPositions: ['4', '9'],
  errors: [],
  qSupport: 2,
  qIds: [1, 0, 2, 0, 0, 1, 0, 0],
  qProbs: [0.5, 0.5, 1, 0, 0.6, 0.4, 0, 0],
};
const TARGET = [
  [[0.5, 0.2, 0.3], [0.3, 0.1, 0.6], [1, 0, 0]],
  [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1, 0, 0]],
];
const fake = {
  AllocState(call, callback) {
    requests.push(call.request);
    callback(null, { stateId: '9' });
  },
  Propose(call, callback) {
    requests.push(call.request);
    callback(null, { stateId: '9', tokens: [3, 4], probs: [0.75, 1], qSupport: 2, qIds: [3, 5, 4, 0], qProbs: [0.75, 0.25, 1, 0] });
  },
  ProposeBatch(call, callback) {
    requests.push(call.request);
    callback(null, SAMPLED);
  },
};

let server;
let address;
before(async () => {
  ({ server, address } = await startFake(fake));
});
after(() => server.forceShutdown());

const hot = { temperature: 0.75, topK: 4, seed: 7n };
const hotOnWire = { temperature: 0.75, topK: 4, topP: 0, minP: 0, seed: '7' };

test('sampling goes with allocState and propose; a proposal carries its q', async () => {
  const drafter = new DrafterClient(address);
  try {
    requests.length = 0;
    await drafter.allocState(null, { sampling: hot });
    await drafter.allocState();
    assert.deepEqual(requests[0].sampling, hotOnWire);
    assert.equal(requests[1].sampling, null);
    const p = await drafter.propose('9', {
      token: 1, hidden: Tensor.fp32([0]), position: 3, numDrafts: 0, sampling: hot, draftCap: 5, verifyTokenCost: 0.25,
    });
    assert.deepEqual(requests[2].sampling, hotOnWire);
    assert.equal(requests[2].numDrafts, 0);
    assert.equal(requests[2].draftCap, 5);
    assert.equal(requests[2].verifyTokenCost, 0.25);
    assert.equal(p.qSupport, 2);
    assert.deepEqual(p.qIds, [[3, 5], [4, 0]]);
    assert.deepEqual(p.qProbs, [[0.75, 0.25], [1, 0]]);
  } finally {
    drafter.close();
  }
});

test('batchOf makes the sampling and draft-cap columns; the answer carries q', async () => {
  const drafter = new DrafterClient(address);
  try {
    requests.length = 0;
    const batch = batchOf([
      { stateId: '3', token: 1, hidden: Tensor.fp32([0]), position: 4, numDrafts: 2, sampling: hot },
      { stateId: '4', token: 2, hidden: Tensor.fp32([0]), position: 6, numDrafts: 0, draftCap: 3, verifyTokenCost: 0.5 },
      { stateId: '5', token: 3, hidden: Tensor.fp32([0]), position: 8, numDrafts: 1, sampling: { temperature: 0 } },
    ]);
    assert.deepEqual(batch.samplingRows, [0, 2]);
    assert.deepEqual(batch.draftCaps, [0, 3, 0]);
    assert.deepEqual(batch.verifyTokenCosts, [0, 0.5, 0]);
    await drafter.proposeBatch(batch);
    const sent = requests[0];
    assert.deepEqual(sent.samplingRows, [0, 2]);
    assert.deepEqual(sent.sampling, [hotOnWire, { temperature: 0, topK: 0, topP: 0, minP: 0, seed: '0' }]);
    assert.deepEqual(sent.draftCaps, [0, 3, 0]);
    assert.deepEqual(sent.verifyTokenCosts, [0, 0.5, 0]);
    const plain = batchOf([{ stateId: '3', token: 1, hidden: Tensor.fp32([0]), position: 4, numDrafts: 2 }]);
    assert.equal(plain.samplingRows, undefined);
    assert.equal(plain.draftCaps, undefined);

    const step = await drafter.proposeBatch(batchOf([
      { stateId: '3', token: 1, hidden: Tensor.fp32([0]), position: 3, numDrafts: 2 },
      { stateId: '4', token: 2, hidden: Tensor.fp32([0]), position: 8, numDrafts: 2 },
    ]));
    assert.equal(step.qSupport, 2);
    assert.deepEqual(Array.from(step.qIds), SAMPLED.qIds);
    assert.deepEqual(step.proposal(1).qIds, [[0, 1]]);
    assert.deepEqual(step.proposal(1).qProbs, [[Math.fround(0.6), Math.fround(0.4)]]);
  } finally {
    drafter.close();
  }
});

test('acceptBatch takes an answer as it is', async () => {
  const drafter = new DrafterClient(address);
  try {
    const step = await drafter.proposeBatch({
      stateIds: ['3', '4'], tokens: [1, 2], positions: [3, 8], hiddens: Tensor.fp32([0, 0], [2, 1]), numDrafts: 2,
    });
    // accept.test.js's worked example: row 0 keeps 1 and draws 1, row 1 keeps 1 and draws 0.
    const verdict = acceptBatch(step, TARGET, { uniforms: [[0.3, 0.7, 0.8], [0.9, 0, 0.05]] });
    assert.deepEqual(verdict, { numAccepted: Int32Array.from([1, 1]), nextTokens: Int32Array.from([1, 0]) });
    // Without q (no row sampled) each draft is its own q at 1: row 0 keeps draft 1 (p 0.2 > u
    // 0.1) and refuses draft 2 (p 0.6 < 0.7), then draws 1 from (0.3, 0.1, 0) / 0.4 at 0.8;
    // row 1 refuses its draft (p 0.7 < 0.9), then draws 1 from (0, 0.2, 0.1) / 0.3 at 0.5.
    const greedy = { ...step, qSupport: 0, qIds: new Int32Array(0), qProbs: new Float32Array(0) };
    const plain = acceptBatch(greedy, TARGET, { uniforms: [[0.1, 0.7, 0.8], [0.9, 0, 0.5]] });
    assert.deepEqual(plain, { numAccepted: Int32Array.from([1, 0]), nextTokens: Int32Array.from([1, 1]) });
  } finally {
    drafter.close();
  }
});
