// C functions of the clover model in libllama (src/models/clover.cpp), for the clover tools and common/speculative's
// draft-clover: not part of llama.h.
#pragma once

#include "llama.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

// A sequence's settings are its context's named per-sequence values (llama_set_seq_param in llama.h): contexts that
// share a model keep their own. The graph reads them whenever a ubatch of the sequence is decoded.
//
// The block coreset's top_p (spec 3.3) of the sequence's block passes, in (0, 1]; 1 = no coreset (per-row routing).
// Unset (NAN), or outside (0, 1], it is the GGUF's ARCH.diffusion.coreset_top_p (default 1). Each window of a batched
// block pass routes inside its own sequence's coreset, so sequences with different values share a pass (a pass
// whose windows all move to or from "every window at 1" rebuilds the graph).
#define LLAMA_CLOVER_PARAM_CORESET_TOP_P "clover.coreset_top_p"
// A fused verify + draft pass (docs/native.md, "The fused pass"): the last n rows (n >= 1) of the sequence's next
// causal ubatch are a block window (spec section 3) over the history and the causal rows before them, in one graph.
// The causal rows write the history as usual; the window's cells must be removed after the pass (seq_rm at its
// first position or before), which the recurrent memory needs n_rs_seq >= the rows removed for. Unset (NAN) or
// below 1: none. Set it right before that decode and clear it right after: every causal ubatch of the sequence
// reads it. A model without block-diffusion tensors ignores it.
#define LLAMA_CLOVER_PARAM_FUSED_WINDOW "clover.fused_window"

// the GGUF's coreset top_p (or its default, 1); -1 for a model that is not clover_moe
LLAMA_API float llama_clover_gguf_coreset_top_p(const struct llama_model * model);
// whether the file holds the block-diffusion tensors (false: a trunk-only file, causal mode only)
LLAMA_API bool  llama_clover_has_block_diffusion(const struct llama_model * model);
// the block size B of the model's block passes (ARCH.block_size, spec 2.2); 0 for a model without block passes (not
// clover_moe, or a trunk-only file)
LLAMA_API int32_t llama_clover_block_size(const struct llama_model * model);
// the fill threshold of block diffusion at block size B (spec 4.1, 4.3): the GGUF's calibrated threshold for B when
// ARCH.diffusion.calibrated_block_sizes lists B (this toolkit's extension, docs/gguf-format.md), else
// ARCH.diffusion.threshold (default 0.95), as stored (float32); -1 for a model that is not clover_moe
LLAMA_API float llama_clover_threshold(const struct llama_model * model, int32_t block_size);
// A block pass (spec section 3) over windows of n sequences, each on scratch[i], a copy of history[i] that the pass
// reads and never writes back. begin removes each scratch sequence, copies its history there (seq_cp: copy-on-write
// for the recurrent state, shared KV cells in a unified cache) with the history's coreset top_p, and turns causal
// attention off; the caller then decodes the windows (at positions after each history) with any batch API; end
// restores the causal flag begin returned and removes the scratch sequences. The drafter (common/speculative's
// draft-clover) and the clover tools run their block passes this way.
LLAMA_API bool  llama_clover_block_begin(struct llama_context * ctx, const llama_seq_id * history,
                                         const llama_seq_id * scratch, int32_t n);
LLAMA_API void  llama_clover_block_end(struct llama_context * ctx, const llama_seq_id * scratch, int32_t n,
                                       bool causal);
// Attach the block-diffusion keys and tensors of a sidecar GGUF (spec v2 section 5) to a trunk-only model, before
// any context is created from it. Each tensor goes to the buffer type of its layer's ssm_conv1d. The caller checks
// the trunk fingerprint (clover_read_info). Returns false, with a message naming the file and the tensor or key in
// err, and the model unchanged, on any failure.
LLAMA_API bool  llama_clover_attach_block_diffusion(struct llama_model * model, const char * path, char * err,
                                                    size_t err_size);

#ifdef __cplusplus
}
#endif
