#!/usr/bin/env node
'use strict';
// Checks accept (sampling.js) against the sampling vector (tests/conformance/sampling_vector.json),
// no server needed:
//   node sampling_conformance.js [--vector PATH]
// One line per case, then "node: N passed, M failed"; exits 1 on any failure, 2 on a vector no
// runner may check (a wrong format, no cases, a case without drafts, q_ids, q_probs,
// target_probs, uniforms or expect).

const fs = require('node:fs');
const path = require('node:path');
const { accept } = require('./sampling.js');

const FORMAT = 'mtpdraft-sampling/1';
const INPUTS = ['drafts', 'q_ids', 'q_probs', 'target_probs', 'uniforms'];

function parseArgs(argv) {
  const args = { vector: path.resolve(__dirname, '..', '..', 'tests', 'conformance', 'sampling_vector.json') };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--vector') args.vector = argv[++i];
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  return args;
}

// Why no runner may check the vector, or null if one may.
function vectorFault(v) {
  if (v === null || typeof v !== 'object' || Array.isArray(v)) return 'the vector is not a JSON object';
  if (v.format !== FORMAT) return `format is ${JSON.stringify(v.format)}, not "${FORMAT}"`;
  if (!Array.isArray(v.cases) || v.cases.length === 0) return 'cases is missing or empty';
  for (const [i, c] of v.cases.entries()) {
    const name = c && c.name;
    for (const key of INPUTS) {
      if (!(c && Array.isArray(c[key]) && c[key].length > 0)) return `case ${i} (${name}): ${key} is missing or empty`;
    }
    const e = c.expect;
    const rows = c.drafts.length;
    if (!(e && Array.isArray(e.num_accepted) && e.num_accepted.length === rows &&
          Array.isArray(e.next_tokens) && e.next_tokens.length === rows)) {
      return `case ${i} (${name}): expect is missing or not one value a row`;
    }
  }
  return null;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  let vector;
  try {
    vector = JSON.parse(fs.readFileSync(args.vector, 'utf8'));
  } catch (err) {
    console.error(`node: bad vector: ${err.message}`);
    return 2;
  }
  const fault = vectorFault(vector);
  if (fault) {
    console.error(`node: bad vector: ${fault}`);
    return 2;
  }
  let passed = 0;
  let failed = 0;
  for (const c of vector.cases) {
    let got;
    try {
      got = accept(c.drafts, c.q_ids, c.q_probs, c.target_probs, { counts: c.counts, uniforms: c.uniforms });
    } catch (err) {
      failed++;
      console.log(`FAIL ${c.name}: ${err.message}`);
      continue;
    }
    const kept = Array.from(got.numAccepted);
    const next = Array.from(got.nextTokens);
    const shown = `kept [${kept}], next [${next}]`;
    if (String(kept) === String(c.expect.num_accepted) && String(next) === String(c.expect.next_tokens)) {
      passed++;
      console.log(`ok   ${c.name}: ${shown}`);
    } else {
      failed++;
      console.log(`FAIL ${c.name}: ${shown}; expected kept [${c.expect.num_accepted}], next [${c.expect.next_tokens}]`);
    }
  }
  console.log(`node: ${passed} passed, ${failed} failed`);
  return failed > 0 ? 1 : 0;
}

process.exitCode = main();
