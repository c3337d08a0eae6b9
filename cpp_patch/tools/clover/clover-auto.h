// Auto mode and its cost table (clover-auto.cpp). Not part of the C API.

#pragma once

#include "clover.h"

#include <algorithm>
#include <cstdint>
#include <vector>

struct clover_slot;
struct clover_run;

// The cost table corrected by the passes a run times. A table is measured once, from about two dozen passes that
// take a few ms, and a disturbance in those ms skews it for the engine's life: twelve measurements in a row on a
// 2-core EPYC gave ar steps of 0.25 to 0.64 ms on the demo model. A table that overrates multi-row passes keeps
// auto in ar steps (TPF 1.00), and one that underrates them makes it slower than ar. Each kind of pass (ar step,
// chain pass, block pass) scales the table by the median of its last observed / predicted times, from its third
// observation on: one slow pass (the first after an idle spell, a preempted one) is always outvoted. Passes shared
// with other slots are not observed.
struct clover_cost_ratio {
    static constexpr int32_t N = 9;
    double  recent[N] = {};
    int32_t n = 0;  // observations so far (the last N are kept)

    void observe(double ms, double predicted) {
        if (ms > 0.0 && predicted > 0.0) {
            recent[n++ % N] = ms / predicted;
        }
    }

    static constexpr int32_t MIN = 3;

    // the median ratio, or `otherwise` before MIN observations
    double scale(double otherwise) const {
        if (n < MIN) {
            return otherwise;
        }
        std::vector<double> v(recent, recent + std::min(n, N));
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v[v.size() / 2];
    }
};

struct clover_cost_correction {
    clover_cost_ratio ar;
    clover_cost_ratio chain;
    clover_cost_ratio block;

    // The table with every kind scaled by its correction. A kind not yet observed takes the scale of the one
    // before it (block passes that of chain passes, chain passes that of ar steps): a machine that runs slower
    // than it measured runs every kind slower, and scaling only the observed kinds would make the others look
    // cheap (block rounds, which auto does not probe, taken where they do not pay).
    clover_pass_costs apply(const clover_pass_costs & c) const {
        const double s_ar    = ar.scale(1.0);
        const double s_chain = chain.scale(s_ar);
        const double s_block = block.scale(s_chain);
        clover_pass_costs out = c;
        out.ar_ms           = (float) (c.ar_ms * s_ar);
        out.causal_fixed_ms = (float) (c.causal_fixed_ms * s_chain);
        out.causal_row_ms   = (float) (c.causal_row_ms * s_chain);
        out.block_fixed_ms  = (float) (c.block_fixed_ms * s_block);
        out.block_row_ms    = (float) (c.block_row_ms * s_block);
        return out;
    }
};

// Auto mode's probe of a kind of round its cost table rules out (clover-auto.cpp): the kind is still taken now
// and then, so that its passes are timed and its drafts scored. Every FIRST rounds without it until the table's
// correction has `n_min` observations of it, then after twice as many rounds at each probe (a few probes over a
// slot's life, so their cost stays small); the count starts again when the kind is chosen on its merits.
struct clover_probe {
    static constexpr int32_t FIRST = 8;
    static constexpr int32_t LAST  = 1024;
    int32_t wait  = 0;
    int32_t every = FIRST;
    int32_t n     = 0;  // probes so far

    bool due(int32_t n_min) { return n < n_min ? ++wait >= FIRST : ++wait >= every; }
    void probed(int32_t n_min) {
        wait  = 0;
        every = ++n < n_min ? FIRST : std::min(2 * every, LAST);
    }
    void chosen() { *this = {}; }
};

// What auto learns of its cost table across a slot's calls (a chat's short answers do not each pay the first
// probes); cleared when the table is measured or set.
struct clover_auto_feedback {
    clover_cost_correction correction;
    clover_probe           chain_probe;
};


// auto mode (clover-auto.cpp)
bool clover_run_auto(clover_run & run);
bool clover_measure_costs(clover_slot * slot, clover_pass_costs & out);
