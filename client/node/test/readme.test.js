'use strict';
// README.md's "Sampled drafts" example, run as written against a fake Drafter whose answers
// carry q: each step's verdicts and next tokens are the next batch's.

const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { after, before, test } = require('node:test');
const client = require('../index.js');
const { startFake } = require('./fake_server.js');

const VOCAB = 8;
const K = 4;
const batches = [];
const fake = {
  AllocState(call, callback) {
    assert.equal(call.request.sampling.temperature, 0.800000011920929); // as float32
    callback(null, { stateId: '9' });
  },
  // One state, K drafts of token 3, each with q (3: 0.75, 5: 0.25).
  ProposeBatch(call, callback) {
    const req = call.request;
    batches.push(req);
    callback(null, {
      width: K, drafts: Array(K).fill(3), probs: Array(K).fill(0.75), draftCounts: [K], confidences: [0.75],
      firstPositions: [String(Number(req.positions[0]) + 1)], errors: [],
      qSupport: 2, qIds: Array(K).fill([3, 5]).flat(), qProbs: Array(K).fill([0.75, 0.25]).flat(),
    });
  },
};

let server;
let address;
before(async () => {
  ({ server, address } = await startFake(fake));
});
after(() => server.forceShutdown());

function readmeBlock(heading) {
  const text = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
  const section = text.slice(text.indexOf(`\n## ${heading}\n`));
  return section.match(/```js\n([\s\S]*?)```/)[1];
}

test("README's sampled example runs, each step's verdicts going into the next", async () => {
  const drafter = new client.DrafterClient(address);
  const hiddens = (n) => client.Tensor.fp32(new Float32Array(n * 4), [n, 4]);
  // The target's distributions: uniform over VOCAB tokens at every position.
  const targetProbs = (r) => Array.from({ length: r.counts.length }, () =>
    Array.from({ length: r.width + 1 }, () => Array(VOCAB).fill(1 / VOCAB)));
  const require = (name) => (name === 'mtpdraft-client' ? client : assert.fail(name));
  const run = new (async () => {}).constructor('require', 'drafter', 'hiddens', 'targetProbs', readmeBlock('Sampled drafts'));
  try {
    await run(require, drafter, hiddens, targetProbs);
  } finally {
    drafter.close();
  }
  assert.equal(batches.length, 3);
  for (const [prev, next] of [[batches[0], batches[1]], [batches[1], batches[2]]]) {
    const [a] = next.numAccepted;
    assert.ok(a >= 0 && a <= K, `verdict ${a}`);
    assert.equal(Number(next.positions[0]), Number(prev.positions[0]) + 1 + a);
    assert.ok(next.tokens[0] >= 0 && next.tokens[0] < VOCAB);
  }
});
