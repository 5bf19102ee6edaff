'use strict';
// Deadlines against an in-process fake Drafter: the client's timeoutMs bounds its unary calls,
// never a stream; a stream opened with its own timeoutMs ends with DEADLINE_EXCEEDED.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { setTimeout: sleep } = require('node:timers/promises');
const { DrafterClient, DrafterError, Tensor } = require('../index.js');
const { startFake } = require('./fake_server.js');

const SHORT_MS = 300; // the client's default timeout, and an explicit stream's deadline
const PAST_MS = 700; // how long each stream is kept open before its next message

// Every stream message (a batch of one) is answered at once: one draft, its token + 1.
const fake = {
  GetInfo(call, callback) {
    setTimeout(() => callback(null, {}), PAST_MS); // slower than the client's timeout
  },
  ProposeStream(call) {
    call.on('data', (req) =>
      call.write({
        requestId: req.requestId, width: 1, drafts: [req.tokens[0] + 1], probs: [1], draftCounts: [1],
        confidences: [1], firstPositions: ['2'], errors: [],
      }),
    );
    call.on('end', () => call.end());
  },
};

let server;
let drafter;

before(async () => {
  let address;
  ({ server, address } = await startFake(fake));
  drafter = new DrafterClient(address, { timeoutMs: SHORT_MS });
});

after(() => {
  drafter.close();
  server.forceShutdown();
});

const args = { token: 1, hidden: Tensor.fp32([1, 2, 3, 4]), position: 1, numDrafts: 1 };
const batch = { stateIds: [1], tokens: [1], positions: [1], hiddens: Tensor.fp32([1, 2, 3, 4], [1, 4]), numDrafts: 1 };
const expired = (err) => err instanceof DrafterError && err.codeName === 'DEADLINE_EXCEEDED';

test("a unary call has the client's timeout", async () => {
  await assert.rejects(drafter.getInfo(), expired);
});

test("streams outlive the client's timeout", async () => {
  const stream = drafter.stream();
  assert.deepEqual((await stream.propose('7', args)).tokens, [2]);
  await sleep(PAST_MS);
  assert.deepEqual((await stream.propose('7', args)).tokens, [2]);
  assert.deepEqual((await stream.step(batch)).counts, Int32Array.of(1));
  await stream.close();
});

test('a stream opened with a timeout expires', async () => {
  const stream = drafter.stream({ timeoutMs: SHORT_MS });
  assert.deepEqual((await stream.propose('7', args)).tokens, [2]);
  await sleep(PAST_MS);
  await assert.rejects(stream.propose('7', args), expired);
  await assert.rejects(stream.step(batch), expired);
  await stream.close();
});
