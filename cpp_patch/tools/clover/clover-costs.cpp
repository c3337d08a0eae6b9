// What a slot's passes cost (clover_slot_measure_costs): ar steps, causal passes of a few widths and block
// passes, timed on the scratch sequence. A measurement for benchmarks and capacity planning; no decoding rule
// reads it (auto mode's policy times its own rounds, common/speculative's draft-clover). Not part of the C API.

#include "clover-costs.h"
#include "clover-decode.h"
#include "clover-log.h"
#include "clover-parallel.h"
#include "clover-slot.h"

#include <algorithm>
#include <vector>

namespace {

// passes on the scratch sequence (a copy of the history, removed afterwards): the history is never written
struct clover_scratch {
    clover_slot * slot;
    llama_batch     batch;
    int32_t         pos;

    explicit clover_scratch(clover_slot * s) : slot(s), batch(llama_batch_init(s->max_block_size + 8, 0, 1)), pos(s->n_past) {
        llama_memory_seq_rm(slot->mem, slot->seq_scratch, -1, -1);
        llama_memory_seq_cp(slot->mem, slot->seq_history, slot->seq_scratch, -1, -1);
    }

    ~clover_scratch() {
        llama_batch_free(batch);
        llama_memory_seq_rm(slot->mem, slot->seq_scratch, -1, -1);
    }

    // a causal pass of w tokens with all rows, then a rollback keeping its first position (as a verification
    // that accepts nothing); the time of the decode in ms, or < 0 on error
    double causal(llama_token tok, int32_t w) {
        clover_batch_clear(batch);
        for (int32_t j = 0; j < w; ++j) {
            clover_batch_add(batch, tok, pos + j, slot->seq_scratch, true);
        }
        const double t0 = clover_now_ms();
        const int32_t rc = clover_shared_call(slot, [this] { return llama_decode(slot->ctx, batch); });
        const double ms = clover_now_ms() - t0;
        if (rc != 0 || (w > 1 && !llama_memory_seq_rm(slot->mem, slot->seq_scratch, pos + 1, -1))) {
            slot->last_error = clover_format("a pass failed while measuring pass costs (code %d)", rc);
            return -1.0;
        }
        pos += 1;
        return ms;
    }
};

double clover_median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// a run of n same-width causal passes: (first pass, median of the rest), both in ms
bool clover_measure_chain(clover_slot * slot, llama_token tok, int32_t w, int32_t n, double & first, double & steady) {
    clover_scratch scratch(slot);
    std::vector<double> rest;
    for (int32_t i = 0; i < n; ++i) {
        const double ms = scratch.causal(tok, w);
        if (ms < 0) {
            return false;
        }
        if (i == 0) {
            first = ms;
        } else {
            rest.push_back(ms);
        }
    }
    steady = clover_median(rest);
    return true;
}

// a block pass of w rows right after a 1-token causal pass (as in auto's loop), in ms: the second of two such
// pairs, so that with the graph cache its graph is a kept one, as in a steady run (without it, both rebuild)
bool clover_measure_block(clover_slot * slot, llama_token tok, int32_t w, double & ms) {
    std::vector<llama_token> window(w, slot->info.mask_token_id);
    window[0] = tok;
    std::vector<int32_t> rows(w);
    for (int32_t j = 0; j < w; ++j) {
        rows[j] = j;
    }
    for (int pair = 0; pair < 2; ++pair) {
        {
            clover_scratch scratch(slot);
            if (scratch.causal(tok, 1) < 0) {
                return false;
            }
        }
        const double t0 = clover_now_ms();
        if (!clover_block(slot, window, rows)) {
            return false;
        }
        ms = clover_now_ms() - t0;
    }
    return true;
}

} // namespace

// Runs of 6 ar steps and of 5 causal passes of 2 and w_hi rows (fixed and per-row cost from their steady
// passes; the rebuild cost from their first passes), and block passes of 2 and w_hi rows, each after an ar
// step and timed the second time: 24 passes on the scratch sequence, repeated while the whole takes less than
// 200 ms (at most 4 times; noise only adds time, so the minimum of the repetitions is kept). A model whose passes
// take 10 ms or more is measured once.
bool clover_measure_costs(clover_slot * slot, clover_pass_costs & out) {
    const int32_t room = slot->n_ctx - slot->n_past;
    const int32_t w_hi = std::min({ 8, slot->max_block_size, room - 8 });
    if (w_hi < 3) {
        slot->last_error = clover_format("measuring pass costs needs 11 free positions and max_block_size >= 3 "
                                         "(free %d, max_block_size %d)", room, slot->max_block_size);
        return false;
    }
    const llama_token tok = slot->has_pending ? slot->pending : 0;
    double ar = 1e30, c2 = 1e30, cw = 1e30, rebuild = 1e30, b2 = 1e30, bw = 1e30;
    const double t_start = clover_now_ms();
    for (int rep = 0; rep < 4 && (rep < 1 || clover_now_ms() - t_start < 200.0); ++rep) {
        double first = 0.0, steady = 0.0, t = 0.0;
        if (!clover_measure_chain(slot, tok, 1, 6, first, steady)) { return false; }
        ar = std::min(ar, steady);
        double rb = first - steady;
        if (!clover_measure_chain(slot, tok, 2, 5, first, steady)) { return false; }
        c2 = std::min(c2, steady);
        rb = std::min(rb, first - steady);
        if (!clover_measure_chain(slot, tok, w_hi, 5, first, steady)) { return false; }
        cw = std::min(cw, steady);
        rebuild = std::min(rebuild, std::min(rb, first - steady));
        if (!slot->can_block) {  // a trunk-only file (or no mask token): no block passes to measure
            b2 = bw = 0.0;
            continue;
        }
        if (!clover_measure_block(slot, tok, 2, t)) { return false; }
        b2 = std::min(b2, t);
        if (!clover_measure_block(slot, tok, w_hi, t)) { return false; }
        bw = std::min(bw, t);
    }
    out = {};
    out.ar_ms           = (float) ar;
    out.causal_row_ms   = (float) std::max(0.0, (cw - c2) / (w_hi - 2));
    out.causal_fixed_ms = (float) std::max(0.0, c2 - 2 * out.causal_row_ms);
    out.rebuild_ms      = (float) std::max(0.0, rebuild);
    out.block_row_ms    = (float) std::max(0.0, (bw - b2) / (w_hi - 2));
    out.block_fixed_ms  = (float) std::max(0.0, b2 - 2 * out.block_row_ms);
    return true;
}
