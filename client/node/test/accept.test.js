'use strict';
// accept (sampling.js), the verifier's acceptance rule: worked examples, its defaults and the
// inputs it refuses. The sampling vector (sampling_conformance.js) checks it case by case.

const assert = require('node:assert/strict');
const { test } = require('node:test');
const { accept } = require('../index.js');

// Two rows, K = 2, V = 3. Row 0: draft 1 has p 0.2, q 0.5: kept at u = 0.3 (< 0.4); draft 2
// has p 0.6, q 1: refused at u = 0.7; the next token comes from max(p - q, 0) =
// (0.3, 0.1, 0) / 0.4 at u = 0.8: token 1. Row 1 has one draft (count 1), kept (p >= q); the
// bonus token comes from (0.1, 0.1, 0.8) at u = 0.05: token 0.
function handExample() {
  return {
    drafts: [[1, 2], [0, 0]],
    qIds: [[[1, 0], [2, 0]], [[0, 1], [0, 1]]],
    qProbs: [[[0.5, 0.5], [1, 0]], [[0.6, 0.4], [1, 0]]],
    targetProbs: [
      [[0.5, 0.2, 0.3], [0.3, 0.1, 0.6], [1, 0, 0]],
      [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1, 0, 0]],
    ],
    counts: [2, 1],
    uniforms: [[0.3, 0.7, 0.8], [0.9, 0, 0.05]],
  };
}

const run = (x) => accept(x.drafts, x.qIds, x.qProbs, x.targetProbs, { counts: x.counts, uniforms: x.uniforms });

test('the worked example, as arrays and as typed arrays', () => {
  const x = handExample();
  assert.deepEqual(run(x), { numAccepted: Int32Array.from([1, 1]), nextTokens: Int32Array.from([1, 0]) });
  const typed = {
    ...x,
    drafts: x.drafts.map((r) => Int32Array.from(r)),
    qProbs: x.qProbs.map((r) => r.map((s) => Float64Array.from(s))),
    targetProbs: x.targetProbs.map((r) => r.map((s) => Float64Array.from(s))),
    counts: Int32Array.from(x.counts),
  };
  assert.deepEqual(Array.from(run(typed).nextTokens), [1, 0]);
});

test('greedy drafts are kept exactly when u < p(draft); counts default to K', () => {
  const p = [[[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]];
  for (const [u, kept] of [[0.59, 1], [0.61, 0]]) {
    const got = accept([[1]], [[[1]]], [[[1]]], p, { uniforms: [[u, 0.5]] });
    assert.equal(got.numAccepted[0], kept, `u = ${u}`);
  }
});

test('p = q leaves no residual: the next token comes from p', () => {
  // The draft has p = q = 0: refused even at u = 0; token 2 of (0, 0.5, 0.5) at u = 0.5.
  const got = accept([[0]], [[[1, 2]]], [[[0.5, 0.5]]], [[[0, 0.5, 0.5], [1, 0, 0]]], { uniforms: [[0, 0.5]] });
  assert.deepEqual(got, { numAccepted: Int32Array.from([0]), nextTokens: Int32Array.from([2]) });
});

test('without uniforms, draws them with `random`', () => {
  const x = handExample();
  const draws = [0.3, 0.7, 0.8, 0.9, 0, 0.05];
  const got = accept(x.drafts, x.qIds, x.qProbs, x.targetProbs, { counts: x.counts, random: () => draws.shift() });
  assert.deepEqual(Array.from(got.numAccepted), [1, 1]);
  assert.deepEqual(Array.from(got.nextTokens), [1, 0]);
  assert.equal(draws.length, 0);
});

test('drafts past a row\'s count are never read', () => {
  const x = handExample();
  x.drafts[1][1] = -5;
  x.qIds[1][1][0] = 99;
  assert.deepEqual(Array.from(run(x).nextTokens), [1, 0]);
});

test('refuses inputs that do not fit, naming the value at fault', () => {
  const cases = [
    [(x) => { x.uniforms.pop(); }, 'uniforms has 1 rows'],
    [(x) => { x.counts[1] = 3; }, 'counts[1] = 3'],
    [(x) => { x.qProbs[0][1].pop(); }, 'qIds[0][1] has 2 ids, qProbs[0][1] 1'],
    [(x) => { x.targetProbs[1][2].pop(); }, 'targetProbs[1][2] has 2 probabilities, want V = 3'],
    [(x) => { x.targetProbs[0].pop(); }, 'targetProbs[0] has 2 distributions, want K + 1 = 3'],
    [(x) => { x.drafts[0][1] = 3; }, 'drafts[0][1] = 3'],
    [(x) => { x.qIds[1][0][1] = 0.5; }, 'qIds[1][0][1] = 0.5'],
    [(x) => { x.targetProbs[0][1][0] = NaN; }, 'targetProbs[0][1][0] = NaN'],
    [(x) => { x.qProbs[1][0][0] = -0.1; }, 'qProbs[1][0][0] = -0.1'],
    [(x) => { x.uniforms[1][2] = 1; }, 'uniforms[1][2] = 1'],
    [(x) => { x.targetProbs[1][1] = [0, 0, 0]; }, 'targetProbs[1][1] has no mass'],
  ];
  for (const [breakIt, says] of cases) {
    const x = handExample();
    breakIt(x);
    assert.throws(() => run(x), (err) => err instanceof RangeError && err.message.includes(says), says);
  }
});
