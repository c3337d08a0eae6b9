// One generate call's state: its sampler, its distribution stage (spec 4) and the run that carries them through
// the decoding loops (set up by clover-params.cpp, used by clover-decode.cpp, clover-sampling.cpp and
// clover-auto.cpp). Not part of the C API.

#pragma once

#include "clover.h"
#include "llama.h"
#include "llama-cpp.h"
#include "sampling.h"  // common/: common_sampler

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

struct clover_slot;

struct clover_sampler {
    std::vector<uint8_t> excluded;  // mask token and banned ids
    std::vector<uint8_t> stop;      // end-of-generation ids
    float temperature = 0.0f;
    // The call's llama.cpp sampler chain, as llama-server builds it for the same request (common_sampler, made by
    // clover_init_chain): its logit bias (the call's, the banned ids, the mask token) and penalties are the
    // distribution stage (spec 4); temperature, top-k, top-p and dist, seeded with the call's seed, draw from Q (a
    // greedy call's chain puts top-k 1 first: the same token, without a draw over the vocabulary). Its grammar
    // sampler is the call's grammar (clover_run::grammar). Verification samples and accepts with it
    // (clover_sample_rows).
    common_sampler_ptr chain;
    std::vector<llama_token_data> cur;  // scratch: the candidates the chain or the grammar runs on

    bool greedy() const { return !(temperature > 0.0f); }
};

// One emitted token's log P and its top alternatives (clover_gen_params.n_logprobs), held until the token is emitted
struct clover_logprob {
    llama_token              token;
    float                    logprob;
    std::vector<llama_token> top_ids;
    std::vector<float>       top_logprobs;
};

// The distribution stage's request state (spec 4): the call's logit_bias and penalties (which the chain applies; the
// penalties count the response's tokens so far) and logprobs (clover-sampling.cpp). The grammar is the chain's.
struct clover_dist {
    std::vector<std::pair<llama_token, float>> bias;
    float repeat    = 1.0f;
    float presence  = 0.0f;
    float frequency = 0.0f;

    llama_sampler * window_penalties = nullptr;  // a window's penalties (clover_window_counts), else the chain's

    int32_t                     n_logprobs = -1;
    std::vector<clover_logprob> logprobs;         // of the tokens produced and not yet emitted, in order
    std::vector<clover_logprob> window_logprobs;  // diffusion: of each window target, from the step that filled it

    bool penalized() const { return repeat != 1.0f || presence != 0.0f || frequency != 0.0f; }
    // the stage changes a logit: a bias or a penalty is set (the banned ids are the excluded ones, set apart)
    bool staged() const { return !bias.empty() || penalized(); }
};

// one generate call
struct clover_run {
    clover_slot             * slot;
    const clover_gen_params * params;
    clover_sampler          smp;
    clover_dist             dist;
    int32_t                 block_size;
    float                   threshold;
    int32_t                 budget;
    int32_t                 n_out = 0;
    clover_tokens_cb        on_tokens;
    clover_step_cb          on_step;
    void                  * user_data;
    clover_stats          * stats;
    bool                    cancelled = false;

    int32_t remaining() const { return budget - n_out; }
    // the call's grammar (the chain's, with its state after the response so far) when it constrains the next token;
    // NULL without one, or while it waits for one of grammar_after_ids
    llama_sampler * grammar() const { return common_sampler_get_grammar(smp.chain.get()); }
    bool is_stop(llama_token t) const { return t >= 0 && t < (llama_token) smp.stop.size() && smp.stop[t]; }
};

inline constexpr llama_token CLOVER_EMPTY = LLAMA_TOKEN_NULL;  // an unfilled canvas target (common/block-diffusion.h)
