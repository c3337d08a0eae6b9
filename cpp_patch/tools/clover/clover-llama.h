// C functions of the clover model in libllama (src/models/clover.cpp), for the clover tools: not part of llama.h.
#pragma once

#include "llama.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

// The block coreset's top_p (spec 3.3) of one sequence's next block passes, in (0, 1]; 1 = no coreset (per-row
// routing); 0 clears it (the sequence then follows the model-wide value below). Each window of a batched block
// pass routes inside its own sequence's coreset, so sequences with different values share a pass. A block graph
// reads the values when its inputs are set, so they may change between passes (a pass whose windows all move to
// or from "every window at 1" rebuilds the graph). The table belongs to the model, indexed by sequence id
// (0 .. LLAMA_MAX_SEQ - 1): contexts that share a model share it, so give them disjoint sequence ids. Returns
// false (nothing set) for a value outside [0, 1], a sequence id out of range or a model that is not clover_moe.
LLAMA_API bool  llama_clover_set_seq_coreset_top_p(struct llama_model * model, llama_seq_id seq_id, float top_p);
// the value a sequence's block passes use (its own, else the model-wide one); -1 for a sequence id out of range
// or a model that is not clover_moe
LLAMA_API float llama_clover_get_seq_coreset_top_p(const struct llama_model * model, llama_seq_id seq_id);
// The model-wide top_p, in (0, 1]: what every sequence without a value of its own uses (deprecated for the
// engine, which sets each slot's sequence; kept for direct callers such as clover_block_decode's). It starts at
// the GGUF's ARCH.diffusion.coreset_top_p (default 1). Returns false (nothing set) for a value outside (0, 1] or
// a model that is not clover_moe.
LLAMA_API bool  llama_clover_set_coreset_top_p(struct llama_model * model, float top_p);
// the model-wide value; -1 for a model that is not clover_moe
LLAMA_API float llama_clover_get_coreset_top_p(const struct llama_model * model);
// the GGUF's value (or its default, 1); -1 for a model that is not clover_moe
LLAMA_API float llama_clover_gguf_coreset_top_p(const struct llama_model * model);
// A fused verify + draft pass (docs/native.md, "The fused pass"): the last n_window rows of the sequence's next
// causal ubatch are a block window (spec section 3) over the history and the causal rows before them, in one graph.
// The causal rows write the history as usual; the window's cells must be removed after the pass (seq_rm at its
// first position or before), which the recurrent memory needs n_rs_seq >= the rows removed for. 0 ends it. Set it
// right before that decode and clear it right after: every causal ubatch of the sequence reads it. Returns false
// for a negative value, a sequence id out of range, a model that is not clover_moe or (n_window > 0) has no
// block-diffusion tensors.
LLAMA_API bool  llama_clover_set_seq_fused_window(struct llama_model * model, llama_seq_id seq_id, int32_t n_window);
// whether the file holds the block-diffusion tensors (false: a trunk-only file, causal mode only)
LLAMA_API bool  llama_clover_has_block_diffusion(const struct llama_model * model);
// Attach the block-diffusion keys and tensors of a sidecar GGUF (spec v2 section 5) to a trunk-only model, before
// any context is created from it. Each tensor goes to the buffer type of its layer's ssm_conv1d. The caller checks
// the trunk fingerprint (clover_read_info). Returns false, with a message naming the file and the tensor or key in
// err, and the model unchanged, on any failure.
LLAMA_API bool  llama_clover_attach_block_diffusion(struct llama_model * model, const char * path, char * err,
                                                    size_t err_size);

#ifdef __cplusplus
}
#endif
