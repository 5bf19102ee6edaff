'use strict';
// allocState's grammar travels as the Grammar message's one kind, an object as JSON text;
// anything but exactly one kind is refused before any call. A propose's grammar, and a batch's
// grammar rows (batchOf's from each request's), travel the same way, { none: true } as none.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { DrafterClient, Tensor, batchOf } = require('../index.js');
const { startFake } = require('./fake_server.js');

const requests = [];
const fake = {
  AllocState(call, callback) {
    requests.push(call.request);
    callback(null, { stateId: '9' });
  },
  Propose(call, callback) {
    requests.push(call.request);
    const asked = call.request.returnBitmasks;
    const bitmasks = { dtype: 'DTYPE_INT32', shape: ['1', '1'], data: Buffer.from([1, 0, 0, 0]) };
    callback(null, { stateId: '9', tokens: [], probs: [], ...(asked ? { bitmasks } : {}) });
  },
  ProposeBatch(call, callback) {
    requests.push(call.request);
    const rows = call.request.stateIds.length;
    callback(null, {
      width: 0, drafts: [], probs: [], draftCounts: new Array(rows).fill(0),
      confidences: new Array(rows).fill(0), firstPositions: new Array(rows).fill('0'), errors: [],
    });
  },
};

let server;
let address;

before(async () => {
  ({ server, address } = await startFake(fake));
});

after(() => server.forceShutdown());

test('a grammar goes with AllocState as its one kind', async () => {
  const drafter = new DrafterClient(address);
  try {
    requests.length = 0;
    assert.equal(await drafter.allocState(), '9');
    await drafter.allocState({ regex: '[a-z]+' });
    await drafter.allocState({ jsonSchema: { type: 'object' } });
    const set = (g) => ['jsonSchema', 'ebnf', 'regex', 'structuralTag'].filter((k) => g[k]);
    const kinds = requests.map((r) => (r.grammar ? set(r.grammar).map((k) => [k, r.grammar[k]])[0] : null));
    assert.deepEqual(kinds, [null, ['regex', '[a-z]+'], ['jsonSchema', '{"type":"object"}']]);
    await assert.rejects(drafter.allocState({ regex: 'a', ebnf: 'root ::= "a"' }), RangeError);
    await assert.rejects(drafter.allocState({ lark: 'x' }), RangeError);
    assert.equal(requests.length, 3);
  } finally {
    drafter.close();
  }
});

test('returnBitmasks asks a Propose for its grammar bitmasks', async () => {
  const drafter = new DrafterClient(address);
  try {
    const args = { token: 1, hidden: Tensor.fp32([0]), position: 1, numDrafts: 1 };
    assert.equal((await drafter.propose('9', args)).bitmasks, undefined);
    const p = await drafter.propose('9', { ...args, returnBitmasks: true });
    assert.deepEqual(p.bitmasks.shape.map(Number), [1, 1]);
  } finally {
    drafter.close();
  }
});

// The Grammar message's kind as [name, source], or null for none sent.
const kindOf = (g) => (g ? Object.entries(g).filter(([k, v]) => k !== 'kind' && v)[0] ?? null : null);

test('a propose gives its state a grammar, none clears it, absent sends none', async () => {
  const drafter = new DrafterClient(address);
  try {
    requests.length = 0;
    const args = { token: 1, hidden: Tensor.fp32([0]), position: 1, numDrafts: 1 };
    await drafter.propose('9', { ...args, grammar: { regex: '[0-3]{4}' } });
    await drafter.propose('9', { ...args, grammar: { none: true } });
    await drafter.propose('9', args);
    assert.deepEqual(requests.map((r) => kindOf(r.grammar)), [['regex', '[0-3]{4}'], ['none', true], null]);
    await assert.rejects(drafter.propose('9', { ...args, grammar: { none: false } }), RangeError);
    await assert.rejects(drafter.propose('9', { ...args, grammar: { none: true, regex: 'a' } }), RangeError);
    assert.equal(requests.length, 3);
  } finally {
    drafter.close();
  }
});

test("batchOf makes the grammar columns of the rows that change grammar, none among them", async () => {
  const drafter = new DrafterClient(address);
  try {
    requests.length = 0;
    const row = (stateId, grammar) => ({ stateId, token: 1, hidden: Tensor.fp32([0]), position: 4, numDrafts: 1, grammar });
    const batch = batchOf([row('3', { none: true }), row('4'), row('5', { jsonSchema: { type: 'string' } })]);
    assert.deepEqual(batch.grammarRows, [0, 2]);
    await drafter.proposeBatch(batch);
    const sent = requests[0];
    assert.deepEqual(sent.grammarRows, [0, 2]);
    assert.deepEqual(sent.grammars.map(kindOf), [['none', true], ['jsonSchema', '{"type":"string"}']]);
    const plain = batchOf([row('3')]);
    assert.equal(plain.grammarRows, undefined);
    await drafter.proposeBatch(plain);
    assert.deepEqual(requests[1].grammarRows, []);
  } finally {
    drafter.close();
  }
});
