'use strict';
// allocState's grammar travels as the Grammar message's one kind, an object as JSON text;
// anything but exactly one kind is refused before any call.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { DrafterClient, Tensor } = require('../index.js');
const { startFake } = require('./fake_server.js');

const requests = [];
const fake = {
  AllocState(call, callback) {
    requests.push(call.request);
    callback(null, { stateId: '9' });
  },
  Propose(call, callback) {
    const asked = call.request.returnBitmasks;
    const bitmasks = { dtype: 'DTYPE_INT32', shape: ['1', '1'], data: Buffer.from([1, 0, 0, 0]) };
    callback(null, { stateId: '9', tokens: [], probs: [], ...(asked ? { bitmasks } : {}) });
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
