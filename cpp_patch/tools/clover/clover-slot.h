// A slot (one history on the engine's context) and the engine that owns the slots: the state every part of
// libclover reads. Not part of the C API.

#pragma once

#include "clover.h"
#include "clover-auto.h"
#include "llama.h"
#include "llama-cpp.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct clover_shared;  // clover-parallel.h

// a copy of the history's recurrent state after its first n_past positions (clover-cache.cpp)
struct clover_checkpoint {
    int32_t              n_past   = 0;
    uint64_t             last_use = 0;
    std::vector<uint8_t> state;
};

// One history on the engine's context (clover.h's struct clover_slot). The model and the context are the
// engine's, borrowed.
struct clover_slot {
    llama_model       * model = nullptr;
    llama_context     * ctx   = nullptr;
    const llama_vocab * vocab = nullptr;
    llama_memory_t      mem   = nullptr;

    clover_model_info info = {};
    // block passes are possible: the file has the block-diffusion tensors and a mask token (else ar and auto with
    // n-gram drafts only; block_unavailable says why)
    bool        can_block = false;
    std::string block_unavailable;
    float       coreset_top_p = 1.0f;  // of this slot's current generation (clover_gen_params.coreset_top_p resolved)

    // this slot's sequences (slot i of n: i, and n + i for its block windows, as common/speculative's draft-clover
    // lays them out)
    llama_seq_id seq_history = 0;
    llama_seq_id seq_scratch = 1;

    // n_parallel > 1: the queue and lock the slots share (null with one slot)
    std::shared_ptr<clover_shared>  shared;
    std::unique_lock<std::mutex>  * lock = nullptr;  // held while this slot runs engine code
    std::vector<float>              rows;      // logits this slot's last pass got in a round
    std::vector<int32_t>            row_of;    // batch row -> index in rows, or -1

    int32_t n_ctx          = 0;  // logical context size (llama.cpp may pad its own)
    int32_t n_batch        = 0;
    int32_t prefill_chunk  = 0;  // prompt tokens per prefill pass while another slot generates (<= n_batch)
    bool    prefilling     = false;  // inside clover_prefill: its passes are chunks (clover_pass_req::prefill)
    int32_t max_block_size = 0;
    int32_t n_vocab        = 0;

    std::vector<llama_token> eog_ids;  // the vocab's end-of-generation set

    // committed history: positions [0, n_past) on seq_history, whose tokens are history; the pending token (the last
    // known token, not yet committed: the spec's "seed"; `seed` in this code is only the sampler's RNG seed)
    // sits at n_past
    int32_t                  n_past      = 0;
    std::vector<llama_token> history;
    bool                     has_pending = false;
    llama_token              pending     = 0;

    llama_batch batch = {};  // this slot's passes (owned)
    int32_t     batch_cap = 0;

    // prefix cache (clover-cache.cpp): checkpoints along the committed history, sorted by n_past
    std::vector<clover_checkpoint> checkpoints;
    int64_t                        cache_max_bytes  = 0;
    int32_t                        checkpoint_every = 0;
    int32_t                        checkpoint_at    = -1;  // where the last prompt left the previous history
    std::vector<int32_t>           checkpoint_hints;       // clover_slot_checkpoint_hint
    bool                           rewound          = false;  // cancelled back to a checkpoint: only reuse_prefix continues
    uint64_t                       cache_clock      = 0;
    clover_cache_info              cache_stats      = {};

    // the recurrent state before the verification running now, when it may reject more positions than the state
    // rolls back (n_rs_seq; clover_verify); n_past = -1: none
    clover_checkpoint verify_checkpoint = { -1, 0, {} };

    clover_drafter * drafter = nullptr;  // auto mode's drafters, the engine's (shared by its slots)

    std::string last_error;

    clover_slot() = default;
    ~clover_slot() { llama_batch_free(batch); }
    clover_slot(const clover_slot &) = delete;
    clover_slot & operator=(const clover_slot &) = delete;
};

// clover.h's struct clover_engine: the model and the context, auto mode's drafters, and the slots that use them
// (declared last, so they go first)
struct clover_engine {
    llama_model_ptr                           model;
    llama_context_ptr                         ctx;
    clover_drafter                            drafter;  // of auto mode, on ctx
    std::vector<std::unique_ptr<clover_slot>> slots;  // slot 0 .. n_parallel - 1
};
