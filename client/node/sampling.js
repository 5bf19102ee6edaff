'use strict';
// The verifier's half of speculative sampling (Leviathan et al. 2023; Chen et al. 2023): which
// drafts to keep, and the token after. The Python client's sampling.accept, token for token
// (tests/conformance/sampling_vector.json); all in float64, as JavaScript numbers are.
//
// Draft j of a row (drawn by the drafter from q_j) is kept if u[j] * q_j(d) < p_j(d), p_j being
// the target's distribution at that position; the drafts kept are those before the first
// refused. At the first refused, the next token is drawn from max(p - q, 0), normalised (from p
// itself where that has no mass); if every draft of the row is kept, the bonus token is drawn
// from p at position count. A token is drawn with u[K] by inverse CDF: the first whose
// normalised cumulative mass exceeds it. The tokens emitted then follow the target's
// distribution whatever q is; greedy drafts are q one-hot.

// accept(drafts [B][K], qIds [B][K][T], qProbs [B][K][T], targetProbs [B][K+1][V],
//        { counts [B], uniforms [B][K+1], random })
//   -> { numAccepted: Int32Array [B], nextTokens: Int32Array [B] }
// Rows are arrays or typed arrays. T may differ from draft to draft (padding: probability 0);
// greedy drafts have T = 1 and probability 1. counts: drafts per row, 0 to K (default K);
// drafts past a row's count are never read. uniforms in [0, 1): one per draft's test, the last
// for the token after; default: drawn with `random` (default Math.random). Throws a RangeError
// for inputs of the wrong shape, ids outside [0, V), probabilities negative or not finite,
// uniforms outside [0, 1), or a distribution to draw from with no mass.
function accept(drafts, qIds, qProbs, targetProbs, { counts, uniforms, random = Math.random } = {}) {
  const b = drafts.length;
  const numAccepted = new Int32Array(b);
  const nextTokens = new Int32Array(b);
  if (b === 0) return { numAccepted, nextTokens };
  const k = drafts[0].length;
  if (uniforms == null) {
    uniforms = Array.from({ length: b }, () => Array.from({ length: k + 1 }, () => random()));
  }
  const vocab = checkShapes(drafts, qIds, qProbs, targetProbs, counts, uniforms, k);
  for (let row = 0; row < b; row++) {
    const count = counts == null ? k : counts[row];
    checkValues(row, count, vocab, drafts, qIds, qProbs, targetProbs, uniforms);
    let kept = 0;
    while (kept < count) {
      const d = drafts[row][kept];
      const q = supportMass(qIds[row][kept], qProbs[row][kept], d);
      if (!(uniforms[row][kept] * q < targetProbs[row][kept][d])) break;
      kept++;
    }
    let dist = targetProbs[row][kept];
    if (kept < count) dist = residual(dist, qIds[row][kept], qProbs[row][kept]);
    const token = inverseCdf(dist, uniforms[row][k]);
    if (token < 0) throw new RangeError(`accept: targetProbs[${row}][${kept}] has no mass`);
    numAccepted[row] = kept;
    nextTokens[row] = token;
  }
  return { numAccepted, nextTokens };
}

// q(d): the probabilities of the support's ids equal to d.
function supportMass(ids, probs, d) {
  let q = 0;
  for (let t = 0; t < ids.length; t++) if (ids[t] === d) q += probs[t];
  return q;
}

// max(p - q, 0) normalised, or p where that has no mass (p = q: no draft is refused then,
// unless p(draft) = q(draft) = 0).
function residual(p, ids, probs) {
  const q = new Float64Array(p.length);
  for (let t = 0; t < ids.length; t++) q[ids[t]] += probs[t];
  const r = new Float64Array(p.length);
  let mass = 0;
  for (let i = 0; i < p.length; i++) {
    r[i] = Math.max(p[i] - q[i], 0);
    mass += r[i];
  }
  if (!(mass > 0)) return p;
  for (let i = 0; i < r.length; i++) r[i] /= mass;
  return r;
}

// The first token whose normalised cumulative mass exceeds u (the last if none does); -1 where
// dist has no mass.
function inverseCdf(dist, u) {
  const cdf = new Float64Array(dist.length);
  let total = 0;
  for (let i = 0; i < dist.length; i++) {
    total += dist[i];
    cdf[i] = total;
  }
  if (!(total > 0)) return -1;
  for (let i = 0; i < cdf.length; i++) if (cdf[i] / total > u) return i;
  return dist.length - 1;
}

function fail(message) {
  throw new RangeError(`accept: ${message}`);
}

// V, after checking that the arrays fit together.
function checkShapes(drafts, qIds, qProbs, targetProbs, counts, uniforms, k) {
  const b = drafts.length;
  for (const [name, a] of [['qIds', qIds], ['qProbs', qProbs], ['targetProbs', targetProbs], ['uniforms', uniforms]]) {
    if (a == null || a.length !== b) fail(`${name} has ${a == null ? 'no' : a.length} rows, drafts ${b}`);
  }
  if (counts != null && counts.length !== b) fail(`counts has ${counts.length} values, drafts ${b} rows`);
  if (!(targetProbs[0].length > 0 && targetProbs[0][0].length > 0)) {
    fail('targetProbs[0] has no distribution over a vocabulary');
  }
  const vocab = targetProbs[0][0].length;
  for (let row = 0; row < b; row++) {
    if (drafts[row].length !== k) fail(`drafts[${row}] has ${drafts[row].length} drafts, drafts[0] ${k}`);
    if (qIds[row].length !== k || qProbs[row].length !== k) {
      fail(`qIds[${row}] and qProbs[${row}] have ${qIds[row].length} and ${qProbs[row].length} supports, want K = ${k}`);
    }
    for (let j = 0; j < k; j++) {
      if (qIds[row][j].length !== qProbs[row][j].length) {
        fail(`qIds[${row}][${j}] has ${qIds[row][j].length} ids, qProbs[${row}][${j}] ${qProbs[row][j].length} probabilities`);
      }
    }
    if (targetProbs[row].length !== k + 1) {
      fail(`targetProbs[${row}] has ${targetProbs[row].length} distributions, want K + 1 = ${k + 1}`);
    }
    for (let j = 0; j <= k; j++) {
      const n = targetProbs[row][j].length;
      if (n !== vocab) fail(`targetProbs[${row}][${j}] has ${n} probabilities, want V = ${vocab}`);
    }
    if (uniforms[row].length !== k + 1) {
      fail(`uniforms[${row}] has ${uniforms[row].length} values, want K + 1 = ${k + 1}`);
    }
    if (counts != null && !(Number.isInteger(counts[row]) && counts[row] >= 0 && counts[row] <= k)) {
      fail(`counts[${row}] = ${counts[row]}, not in [0, K = ${k}]`);
    }
  }
  return vocab;
}

// One row's values: the ids it reads (those of its count's drafts) and every probability and
// uniform.
function checkValues(row, count, vocab, drafts, qIds, qProbs, targetProbs, uniforms) {
  const inVocab = (id) => Number.isInteger(id) && id >= 0 && id < vocab;
  const probability = (p) => p >= 0 && p < Infinity;
  for (let j = 0; j < count; j++) {
    const d = drafts[row][j];
    if (!inVocab(d)) fail(`drafts[${row}][${j}] = ${d}, not in [0, V = ${vocab})`);
    const ids = qIds[row][j];
    for (let t = 0; t < ids.length; t++) {
      if (!inVocab(ids[t])) fail(`qIds[${row}][${j}][${t}] = ${ids[t]}, not in [0, V = ${vocab})`);
    }
  }
  for (const [name, rows] of [['qProbs', qProbs[row]], ['targetProbs', targetProbs[row]]]) {
    for (let j = 0; j < rows.length; j++) {
      for (let i = 0; i < rows[j].length; i++) {
        const p = rows[j][i];
        if (!probability(p)) fail(`${name}[${row}][${j}][${i}] = ${p}, not a probability`);
      }
    }
  }
  for (let j = 0; j < uniforms[row].length; j++) {
    const u = uniforms[row][j];
    if (!(u >= 0 && u < 1)) fail(`uniforms[${row}][${j}] = ${u}, not in [0, 1)`);
  }
}

// accept over a batch's answer (proposeBatch's or a stream step's) as it is: each row's
// `width` drafts, their q (the answer's; where no row was sampled, each draft alone at 1) and
// counts. targetProbs [B][width + 1][V]; options as accept's (uniforms [B][width + 1]).
// A failed row counts no drafts: its next token is drawn from targetProbs[row][0].
function acceptBatch(result, targetProbs, options = {}) {
  const { width, qSupport: support, drafts: flat, qIds, qProbs } = result;
  const drafts = Array.from(result.counts, (_, i) => flat.subarray(i * width, (i + 1) * width));
  const q = (values, i, j, draft) => {
    const at = (i * width + j) * support;
    return support ? values.subarray(at, at + support) : draft;
  };
  const ids = drafts.map((row, i) => Array.from(row, (d, j) => q(qIds, i, j, [d])));
  const probs = drafts.map((row, i) => Array.from(row, (_, j) => q(qProbs, i, j, [1])));
  return accept(drafts, ids, probs, targetProbs, { ...options, counts: result.counts });
}

module.exports = { accept, acceptBatch };
