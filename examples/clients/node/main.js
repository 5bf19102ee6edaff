// @ts-check
'use strict';
// A verifier's decode loop with the mtpdraft Node.js client, installed as a package from its
// folder (package.json: "mtpdraft-client": "file:../../../client/node"):
//
//   npm ci && node main.js --address 127.0.0.1:50051
//
// It prefills a state with a 4-token prompt, then runs 3 verify steps on one stream, each
// deciding the verdict with accept: the drafts are greedy (q one-hot), the target's
// distributions made up, as are the hiddens: a real verifier passes its target's.
// `npm run typecheck` checks this file against the package's types (index.d.ts).

const { DrafterClient, DrafterError, Tensor, accept } = require('mtpdraft-client');

async function main() {
  const at = process.argv.indexOf('--address');
  const address = at >= 0 ? process.argv[at + 1] : 'localhost:50051';
  const drafter = new DrafterClient(address, { timeoutMs: 30000 }); // unary calls only
  const { hiddenSize, vocabSize } = await drafter.getInfo();
  /** @param {number} rows */
  const hiddens = (rows) =>
    Tensor.fp32(Float32Array.from({ length: rows * hiddenSize }, () => Math.random() * 2 - 1), [rows, hiddenSize]);
  // A made-up target distribution giving `token` about half its mass.
  /** @param {number} token */
  const targetProbs = (token) => {
    const w = Float64Array.from({ length: vocabSize }, () => Math.random());
    w[token] = w.reduce((a, b) => a + b, 0);
    const total = 2 * w[token];
    return w.map((x) => x / total);
  };

  const state = await drafter.allocState();
  // Rows (x1, h0) .. (x3, h2) from position 1; x4 is the last prompt token.
  await drafter.prefill(state, 1, [11, 12, 13], hiddens(3));
  const stream = drafter.stream(); // no deadline: it lives as long as the verifier
  try {
    /** @type {import('mtpdraft-client').ProposeArgs} */
    let args = { token: 14, hidden: hiddens(1), position: 4, numDrafts: 3 };
    for (let step = 0; step < 3; step++) {
      const p = await stream.propose(state, args);
      console.log(`step ${step}: drafts ${JSON.stringify(p.tokens)} from position ${p.firstPosition}`);
      // The target's distributions at each draft's position and after the last; greedy
      // drafts have q one-hot.
      const target = [...p.tokens, 0].map(targetProbs);
      const verdict = accept([p.tokens], [p.tokens.map((t) => [t])], [p.tokens.map(() => [1])], [target]);
      const accepted = verdict.numAccepted[0];
      console.log(`step ${step}: kept ${accepted}, next token ${verdict.nextTokens[0]}`);
      args = {
        token: verdict.nextTokens[0], // the correction or bonus token
        hidden: hiddens(1),
        position: p.firstPosition + accepted,
        numDrafts: 3,
        previous: { numAccepted: accepted },
      };
    }
  } finally {
    await stream.close();
    await drafter.freeState(state);
    drafter.close();
  }
  console.log('node example: ok');
}

main().catch((err) => {
  console.error(err instanceof DrafterError ? `${err.codeName} ${err.reason}: ${err.message}` : err);
  process.exit(1);
});
