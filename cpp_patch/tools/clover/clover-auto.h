// Auto mode (clover-auto.cpp): llama.cpp's speculative framework drafts, and common_sampler verifies. Not part of
// the C API.

#pragma once

#include "speculative.h"  // common/

#include <cstdint>
#include <string>

struct clover_run;

// The drafters of an engine's auto mode, shared by its slots: one common_speculative whose sequence i is slot i's
// history, with llama-server's `--spec-type ngram-mod,draft-clover` (ngram-mod alone for a file without block
// passes). Made with the engine, as llama-server makes its own at start, so that no call's decode time pays for them
// (ngram-mod's table is 16 MiB); `error` keeps why that failed, for the first auto call to report.
struct clover_drafter {
    common_speculative_ptr spec;
    std::string            error;
};

void clover_drafter_init(clover_drafter & d, llama_context * ctx, int32_t n_seq, bool can_block);

bool clover_run_auto(clover_run & run);
