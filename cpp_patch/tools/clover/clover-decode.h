// Batches, passes and the decoding loops of one generate call (clover-decode.cpp). Not part of the C API.

#pragma once

#include "clover-run.h"
#include "clover-slot.h"
#include "llama.h"

#include <cstdint>
#include <vector>

// what one verification round did (clover_verify)
struct clover_round {
    int32_t m          = 0;      // positions kept (tokens emitted, an end-of-generation token included)
    int32_t n_compared = 0;      // drafts compared with the causal outputs
    int32_t n_accepted = 0;      // drafts accepted
    bool    hit_eog    = false;  // a_m is an end-of-generation token
};

double      clover_now_ms();
void        clover_histogram_add(int32_t * histogram, int32_t value);

// batches and passes (clover-decode.cpp)
void clover_batch_clear(llama_batch & batch);
void clover_batch_add(llama_batch & batch, llama_token token, llama_pos pos, llama_seq_id seq, bool logits);
// a causal pass appends to the history (seq_history); a block pass reads a scratch copy of it (seq_scratch) and
// never writes the history. `what` names the pass in an error.
bool clover_causal(clover_slot * slot, const llama_token * tokens, int32_t n, const std::vector<int32_t> & rows,
                   const char * what);
bool clover_block(clover_slot * slot, const std::vector<llama_token> & window, const std::vector<int32_t> & rows);
// the logits of output row i (the distribution stage adjusts them in place)
float * clover_get_row(clover_slot * slot, int32_t i);

// the decoding loops of one generate call (clover-decode.cpp)
bool    clover_timed_block(clover_run & run, const std::vector<llama_token> & window, const std::vector<int32_t> & rows);
void    clover_window(const clover_run & run, const std::vector<llama_token> & canvas, std::vector<llama_token> & window);
bool    clover_verify(clover_run & run, const llama_token * drafts, int32_t n_drafts, int32_t width, clover_round & round);
bool    clover_run_ar(clover_run & run);
bool    clover_run_diffusion(clover_run & run);
bool    clover_run_spec(clover_run & run);
