package drafter

import (
	"fmt"
	"math"
)

// Accepted is what a verifier does next, per row: keep NumAccepted drafts (the verdict the
// next ProposeBatch or Propose carries), then emit NextTokens (the correction or the bonus
// token: the next Propose's token).
type Accepted struct {
	NumAccepted []int32
	NextTokens  []int32
}

// Accept is the verifier's half of speculative sampling (Leviathan et al. 2023; Chen et al.
// 2023), over a batch of B rows of K drafts, in float64. The Python client's
// sampling.accept, token for token (tests/conformance/sampling_vector.json).
//
// Draft j of row b (drawn by the drafter from q_j) is kept if u[b][j] * q_j(d) < p_j(d),
// p_j being the target's distribution at that position; the drafts kept are those before
// the first refused. At the first refused, the next token is drawn from max(p - q, 0),
// normalised (from p itself where that has no mass); if all counts[b] drafts are kept, the
// bonus token is drawn from p at position counts[b]. A token is drawn with u[b][K] by
// inverse CDF: the first whose normalised cumulative mass exceeds it. The tokens emitted
// then follow the target's distribution whatever q is; greedy drafts are q one-hot.
//
//   - drafts [B][K]: each row's drafts (past a row's count: anything).
//   - qIDs, qProbs [B][K][T]: each draft's q as its support and their probabilities (T may
//     differ from draft to draft; padding: probability 0). Greedy drafts: T = 1, 1.0.
//   - targetProbs [B][K+1][V]: the target's distribution at each draft's position, then at
//     the position after the last draft.
//   - counts [B]: drafts per row, 0 to K (nil: K for every row).
//   - uniforms [B][K+1] in [0, 1): one per draft's test, the last for the token after
//     (rand.Float64 draws them; fixed ones make the verdicts reproducible).
//
// Inputs of the wrong shape, ids outside [0, V), probabilities that are negative or not
// finite, uniforms outside [0, 1), or a distribution to draw from with no mass are errors.
func Accept(drafts [][]int32, qIDs [][][]int32, qProbs [][][]float64, targetProbs [][][]float64,
	counts []int32, uniforms [][]float64) (Accepted, error) {
	b := len(drafts)
	out := Accepted{NumAccepted: make([]int32, b), NextTokens: make([]int32, b)}
	if b == 0 {
		return out, nil
	}
	k, vocab, err := checkAcceptShapes(drafts, qIDs, qProbs, targetProbs, counts, uniforms)
	if err != nil {
		return Accepted{}, err
	}
	for row := 0; row < b; row++ {
		count := k
		if counts != nil {
			count = int(counts[row])
		}
		if err := checkAcceptValues(row, count, vocab, drafts, qIDs, qProbs, targetProbs, uniforms); err != nil {
			return Accepted{}, err
		}
		accepted := 0
		for accepted < count {
			d := drafts[row][accepted]
			q := supportMass(qIDs[row][accepted], qProbs[row][accepted], d)
			if !(uniforms[row][accepted]*q < targetProbs[row][accepted][d]) {
				break
			}
			accepted++
		}
		dist := targetProbs[row][accepted]
		if accepted < count {
			dist = residual(dist, qIDs[row][accepted], qProbs[row][accepted])
		}
		token, ok := inverseCDF(dist, uniforms[row][k])
		if !ok {
			return Accepted{}, fmt.Errorf("drafter.Accept: targetProbs[%d][%d] has no mass", row, accepted)
		}
		out.NumAccepted[row], out.NextTokens[row] = int32(accepted), int32(token)
	}
	return out, nil
}

// supportMass is q(d): the probabilities of the support's ids equal to d.
func supportMass(ids []int32, probs []float64, d int32) float64 {
	q := 0.0
	for t, id := range ids {
		if id == d {
			q += probs[t]
		}
	}
	return q
}

// residual is max(p - q, 0) normalised, or p where that has no mass (p = q: no draft is
// refused then, unless p(draft) = q(draft) = 0).
func residual(p []float64, ids []int32, probs []float64) []float64 {
	q := make([]float64, len(p))
	for t, id := range ids {
		q[id] += probs[t]
	}
	r, mass := make([]float64, len(p)), 0.0
	for i := range p {
		r[i] = math.Max(p[i]-q[i], 0)
		mass += r[i]
	}
	if !(mass > 0) {
		return p
	}
	for i := range r {
		r[i] /= mass
	}
	return r
}

// inverseCDF is the first token whose normalised cumulative mass exceeds u (the last if none
// does); false where dist has no mass.
func inverseCDF(dist []float64, u float64) (int, bool) {
	cdf, total := make([]float64, len(dist)), 0.0
	for i, m := range dist {
		total += m
		cdf[i] = total
	}
	if !(total > 0) {
		return 0, false
	}
	for i, c := range cdf {
		if c/total > u {
			return i, true
		}
	}
	return len(dist) - 1, true
}

// checkAcceptShapes returns K and V, or what does not fit together.
func checkAcceptShapes(drafts [][]int32, qIDs [][][]int32, qProbs [][][]float64,
	targetProbs [][][]float64, counts []int32, uniforms [][]float64) (int, int, error) {
	b, k := len(drafts), len(drafts[0])
	for _, c := range []struct {
		name string
		rows int
	}{{"qIDs", len(qIDs)}, {"qProbs", len(qProbs)}, {"targetProbs", len(targetProbs)}, {"uniforms", len(uniforms)}} {
		if c.rows != b {
			return 0, 0, fmt.Errorf("drafter.Accept: %s has %d rows, drafts %d", c.name, c.rows, b)
		}
	}
	if counts != nil && len(counts) != b {
		return 0, 0, fmt.Errorf("drafter.Accept: counts has %d values, drafts %d rows", len(counts), b)
	}
	if len(targetProbs[0]) == 0 || len(targetProbs[0][0]) == 0 {
		return 0, 0, fmt.Errorf("drafter.Accept: targetProbs[0] has no distribution over a vocabulary")
	}
	vocab := len(targetProbs[0][0])
	for row := 0; row < b; row++ {
		if len(drafts[row]) != k {
			return 0, 0, fmt.Errorf("drafter.Accept: drafts[%d] has %d drafts, drafts[0] %d", row, len(drafts[row]), k)
		}
		if len(qIDs[row]) != k || len(qProbs[row]) != k {
			return 0, 0, fmt.Errorf("drafter.Accept: qIDs[%d] and qProbs[%d] have %d and %d supports, want K = %d",
				row, row, len(qIDs[row]), len(qProbs[row]), k)
		}
		for j := 0; j < k; j++ {
			if len(qIDs[row][j]) != len(qProbs[row][j]) {
				return 0, 0, fmt.Errorf("drafter.Accept: qIDs[%d][%d] has %d ids, qProbs[%d][%d] %d probabilities",
					row, j, len(qIDs[row][j]), row, j, len(qProbs[row][j]))
			}
		}
		if len(targetProbs[row]) != k+1 {
			return 0, 0, fmt.Errorf("drafter.Accept: targetProbs[%d] has %d distributions, want K + 1 = %d",
				row, len(targetProbs[row]), k+1)
		}
		for j, p := range targetProbs[row] {
			if len(p) != vocab {
				return 0, 0, fmt.Errorf("drafter.Accept: targetProbs[%d][%d] has %d probabilities, want V = %d",
					row, j, len(p), vocab)
			}
		}
		if len(uniforms[row]) != k+1 {
			return 0, 0, fmt.Errorf("drafter.Accept: uniforms[%d] has %d values, want K + 1 = %d", row, len(uniforms[row]), k+1)
		}
		if counts != nil && (counts[row] < 0 || int(counts[row]) > k) {
			return 0, 0, fmt.Errorf("drafter.Accept: counts[%d] = %d, not in [0, K = %d]", row, counts[row], k)
		}
	}
	return k, vocab, nil
}

// checkAcceptValues checks one row's values: the ids it reads (those of its count's drafts)
// and every probability and uniform.
func checkAcceptValues(row, count, vocab int, drafts [][]int32, qIDs [][][]int32, qProbs [][][]float64,
	targetProbs [][][]float64, uniforms [][]float64) error {
	inVocab := func(id int32) bool { return id >= 0 && int(id) < vocab }
	probability := func(p float64) bool { return p >= 0 && !math.IsInf(p, 1) }
	for j := 0; j < count; j++ {
		if !inVocab(drafts[row][j]) {
			return fmt.Errorf("drafter.Accept: drafts[%d][%d] = %d, not in [0, V = %d)", row, j, drafts[row][j], vocab)
		}
		for t, id := range qIDs[row][j] {
			if !inVocab(id) {
				return fmt.Errorf("drafter.Accept: qIDs[%d][%d][%d] = %d, not in [0, V = %d)", row, j, t, id, vocab)
			}
		}
	}
	for j, probs := range qProbs[row] {
		for t, p := range probs {
			if !probability(p) {
				return fmt.Errorf("drafter.Accept: qProbs[%d][%d][%d] = %v, not a probability", row, j, t, p)
			}
		}
	}
	for j, probs := range targetProbs[row] {
		for i, p := range probs {
			if !probability(p) {
				return fmt.Errorf("drafter.Accept: targetProbs[%d][%d][%d] = %v, not a probability", row, j, i, p)
			}
		}
	}
	for j, u := range uniforms[row] {
		if !(u >= 0 && u < 1) {
			return fmt.Errorf("drafter.Accept: uniforms[%d][%d] = %v, not in [0, 1)", row, j, u)
		}
	}
	return nil
}
