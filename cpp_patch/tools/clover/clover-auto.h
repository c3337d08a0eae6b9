// Auto mode (clover-auto.cpp): llama.cpp's speculative framework drafts, and common_sampler verifies. Not part of
// the C API.

#pragma once

#include "speculative.h"  // common/

#include <cstdint>
#include <string>

struct clover_run;
struct clover_slot;

// The drafters of an engine's auto mode, shared by its slots: one common_speculative whose sequence i is slot i's
// history, with llama-server's `--spec-type ngram-mod,draft-clover` (ngram-mod alone for a file without block
// passes). Made with the engine, as llama-server makes its own at start, so that no call's decode time pays for them
// (ngram-mod's table is 16 MiB); `error` keeps why that failed, for the first auto call to report.
struct clover_drafter {
    common_speculative_ptr spec;
    std::string            error;
};

void clover_drafter_init(clover_drafter & d, llama_context * ctx, int32_t n_seq, bool can_block);

// One slot's draft, in two halves around common_speculative_draft, which drafts every sequence asked for in one call
// (draft-clover batches their windows into one block pass): ask sets the slot's draft parameters, at most n_max
// tokens into `draft`; settle detaches `draft` and tells whether it came from draft-clover's block pass.
void clover_draft_ask(common_speculative * spec, const clover_slot * slot, int32_t n_max, llama_tokens & draft);
bool clover_draft_settle(common_speculative * spec, const clover_slot * slot, const llama_tokens & draft);

bool clover_run_auto(clover_run & run);
