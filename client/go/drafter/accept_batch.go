package drafter

import (
	"fmt"
	"math/rand"
)

// AcceptBatch is Accept over a batch's answer, as the verifier's next step takes it: each
// row's Width drafts, their q (the answer's; one-hot where no row was sampled) and Counts.
// targetProbs [B][Width+1][V] is the target's distribution at each draft's position, then
// after the last; uniforms [B][Width+1] as Accept's (nil: drawn with rand.Float64). A failed
// row counts no drafts: its next token is drawn from targetProbs[row][0].
func AcceptBatch(r *BatchResult, targetProbs [][][]float64, uniforms [][]float64) (Accepted, error) {
	drafts, qIDs, qProbs := r.DraftsWithQ()
	if uniforms == nil {
		uniforms = make([][]float64, r.Len())
		for i := range uniforms {
			uniforms[i] = make([]float64, r.Width+1)
			for j := range uniforms[i] {
				uniforms[i][j] = rand.Float64()
			}
		}
	}
	v, err := Accept(drafts, qIDs, qProbs, targetProbs, r.Counts, uniforms)
	if err != nil {
		return Accepted{}, fmt.Errorf("drafter.AcceptBatch: %w", err)
	}
	return v, nil
}

// DraftsWithQ is the answer in Accept's shapes: drafts [B][Width] (-1 past a row's count), and
// each draft's q, qIDs and qProbs [B][Width][support] (the answer's q; where no row was
// sampled, each draft alone at probability 1).
func (r *BatchResult) DraftsWithQ() (drafts [][]int32, qIDs [][][]int32, qProbs [][][]float64) {
	b, k, t := r.Len(), r.Width, r.QSupport
	drafts, qIDs, qProbs = make([][]int32, b), make([][][]int32, b), make([][][]float64, b)
	for i := 0; i < b; i++ {
		drafts[i] = r.Drafts[i*k : (i+1)*k]
		qIDs[i], qProbs[i] = make([][]int32, k), make([][]float64, k)
		for j := 0; j < k; j++ {
			if t == 0 { // greedy drafts: q one-hot
				qIDs[i][j], qProbs[i][j] = []int32{drafts[i][j]}, []float64{1}
				continue
			}
			lo := (i*k + j) * t
			qIDs[i][j], qProbs[i][j] = r.QIDs[lo:lo+t], make([]float64, t)
			for s, p := range r.QProbs[lo : lo+t] {
				qProbs[i][j][s] = float64(p)
			}
		}
	}
	return drafts, qIDs, qProbs
}
