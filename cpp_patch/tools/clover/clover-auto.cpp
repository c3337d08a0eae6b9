// Auto mode: lossless decoding that picks, round by round, what to verify next (docs/decoding.md, "auto").
//
// Every emitted token comes out of a causal verification (clover_verify), so greedy auto equals greedy ar and
// sampled auto keeps ar's distribution (drafts are point masses, accepted with probability Q(d)).
//
// Where the time goes decides the design. Stock llama.cpp reuses a pass's graph only when the previous pass had
// the same shape; a pass whose shape changed pays for building and allocating its graph, which on a small model
// is a large share of the pass. The graph cache (patch 0008, n_graph_cache) keeps the graphs of recent shapes;
// without it the cost table charges rebuild_ms at every change. Auto runs *chains* of same-width causal passes:
// width 1 is an ar step, width w > 1 verifies w - 1 draft tokens and yields 1 to w tokens. The drafts come from
// the history: the tokens that followed the latest earlier occurrence of the last n tokens (llama.cpp's
// common_ngram_simple_draft, n = 3, 2, 1), extended by further lookups and padded with the pending token, so no
// pass is spent on drafting. The width is the one with the best expected tokens per ms in a steady chain,
//     E(w) / cost(w),  E(w) = sum_{k<w} q(1) .. q(k),
// with q(k) the running rate at which draft token k is accepted after k - 1 accepted ones, and cost from the
// table (clover.h); it changes only when another width is at least 5 % better, because a change may cost a
// rebuild (without the graph cache, n_graph_cache = 0, every change of shape does; with it, only a shape's first
// pass). During ar steps the n-gram draft is still looked up and scored against the tokens the steps produce, so
// q stays current. A block draft (one block pass, argmax of every target, verified up to the width that
// maximises the expected tokens per ms given the draft's own confidences) is taken instead when its expected
// rate beats the chain's.
//
// q is a function of the tokens only. A table set with clover_slot_set_costs is kept as given, so a run with it is
// reproducible; a measured one (or a prior) is corrected from the passes auto times, and chain rounds it rules out
// are probed now and then (clover_correct_costs, clover-auto.h).

#include "clover-auto.h"
#include "clover-decode.h"
#include "clover-log.h"
#include "clover-parallel.h"
#include "clover-run.h"
#include "clover-slot.h"

#include "ngram-map.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace {

constexpr double  CLOVER_SWITCH_GAIN = 1.05;  // a new chain width must beat the current one by this factor
constexpr int32_t CLOVER_SHADOW_LEN  = 8;     // drafts scored during ar steps are at most this long, like a
                                              // chain round's, so that the first draft token is scored often

// Acceptance of draft tokens by depth: q(k) = P(draft k accepted | drafts 1 .. k-1 accepted), counted over
// past rounds (recent ones weigh more) and shrunk towards 0.9 q(k-1) where depth k was rarely verified. One rate
// would miss how drafts behave: an n-gram draft is often wrong at its first token and then right for many.
struct clover_accept_rate {
    static constexpr int32_t K = 64;
    double accepted[K + 1] = {};
    double rejected[K + 1] = {};

    double q(int32_t k) const {
        k = std::min(k, K);
        // before any evidence a first draft token is assumed accepted 1 time in 4 (an ar step is the safe start);
        // a depth seldom verified is trusted less than the one before it
        const double prior = k == 1 ? 0.25 : 0.9 * q(k - 1);
        return (accepted[k] + 2.0 * prior) / (accepted[k] + rejected[k] + 2.0);
    }

    // draft token k was (not) accepted after k - 1 accepted ones
    void observe(int32_t k, bool ok) {
        k = std::min(k, K);
        const double decay = 0.9;
        accepted[k] *= decay;
        rejected[k] *= decay;
        (ok ? accepted[k] : rejected[k]) += 1.0;
    }

    void add(const clover_round & r) {
        for (int32_t k = 1; k <= std::min(r.n_compared, r.n_accepted + 1); ++k) {
            observe(k, k <= r.n_accepted);
        }
    }
};

// expected tokens of a width-w verification when draft k is accepted with probability q(k) (1-based)
template <typename Q>
double clover_expected_tokens(Q q, int32_t w) {
    double e = 1.0;
    double all = 1.0;
    for (int32_t k = 1; k < w; ++k) {
        all *= q(k);
        e   += all;
    }
    return e;
}

// a causal pass of w rows in a run of same-width passes (w = 1: an ar step)
double clover_chain_ms(const clover_pass_costs & c, int32_t w) {
    return w == 1 ? c.ar_ms : c.causal_fixed_ms + w * c.causal_row_ms;
}

double clover_block_ms(const clover_pass_costs & c, int32_t w) {
    return c.block_fixed_ms + w * c.block_row_ms;
}

// drafts continuing history + pending token: n-gram lookups (n = 3, 2, 1), repeated on the extended sequence
std::vector<llama_token> clover_ngram_draft(const clover_slot * slot, int32_t max_len) {
    auto lookup = [](const std::vector<llama_token> & seq, llama_token last, int32_t len) {
        llama_tokens more;
        for (uint16_t n = 3; n >= 1 && more.empty(); --n) {
            more = common_ngram_simple_draft({ n, (uint16_t) len }, seq, last);
        }
        return more;
    };
    std::vector<llama_token> draft = lookup(slot->history, slot->pending, max_len);
    if (draft.empty() || (int32_t) draft.size() >= max_len) {
        return draft;
    }
    std::vector<llama_token> seq = slot->history;  // extend: look up again after the drafted tokens
    seq.push_back(slot->pending);
    seq.insert(seq.end(), draft.begin(), draft.end() - 1);
    while ((int32_t) draft.size() < max_len) {
        const llama_tokens more = lookup(seq, draft.back(), max_len - (int32_t) draft.size());
        if (more.empty()) {
            break;
        }
        for (llama_token t : more) {
            seq.push_back(draft.back());
            draft.push_back(t);
        }
    }
    return draft;
}

// During ar steps, the n-gram draft that would have been verified is scored against the tokens the steps
// produce, token by token, at no cost: the acceptance rates stay current while no draft is verified.
struct clover_shadow_draft {
    std::vector<llama_token> draft;
    int32_t                  matched = 0;

    void observe(llama_token token, clover_accept_rate & rate) {
        if (draft.empty()) {
            return;
        }
        const bool ok = token == draft[matched];
        rate.observe(++matched, ok);
        if (!ok || matched == (int32_t) draft.size()) {
            draft.clear();
            matched = 0;
        }
    }
};

// A block draft: one block pass over [pending, prefix, MASK ..] of the given width. The prefix (an n-gram draft,
// possibly empty) stands in the window as known tokens and is the draft's start; the pass drafts the targets after
// it, argmax of each, with its confidence. A prefix token's confidence is the n-gram chain's acceptance rate at
// its depth (the model sees that token in the window, so its own probability of it says little).
bool clover_block_draft(clover_run & run, int32_t width, const std::vector<llama_token> & prefix,
                        const clover_accept_rate & prefix_rate, std::vector<llama_token> & drafts,
                        std::vector<double> & conf) {
    const int32_t k = std::min((int32_t) prefix.size(), width - 1);
    std::vector<llama_token> canvas(width, CLOVER_EMPTY);
    std::copy(prefix.begin(), prefix.begin() + k, canvas.begin());
    conf.resize(width);
    if (!clover_draft_masked(run, canvas, &conf)) {  // the prefix counts for the penalties of the targets after it
        return false;
    }
    for (int32_t j = 0; j < k; ++j) {
        conf[j] = prefix_rate.q(j + 1);
    }
    drafts = std::move(canvas);
    return true;
}

struct clover_auto_state {
    clover_accept_rate  chain_rate;  // draft tokens of chain rounds (n-gram, padded), verified or shadowed
    clover_accept_rate  block_rate;  // draft tokens of block rounds
    clover_shadow_draft shadow;      // the n-gram draft being scored during ar steps
    int32_t             width = 1;   // width of the previous causal pass (0: a block pass came between)
};

// expected tokens per ms of a chain pass of width w in a steady chain
double clover_chain_rate(const clover_pass_costs & c, const clover_auto_state & st, int32_t w, int32_t remaining) {
    return clover_expected_tokens([&](int32_t k) { return st.chain_rate.q(k); }, std::min(w, remaining)) /
           clover_chain_ms(c, w);
}

// the best chain width of at least w_min (w_min = 2: the best one that verifies a draft)
int32_t clover_best_chain_width(const clover_pass_costs & c, const clover_auto_state & st, int32_t w_min,
                                int32_t w_max, int32_t remaining) {
    int32_t best = w_min;
    for (int32_t w = w_min + 1; w <= w_max; ++w) {
        if (clover_chain_rate(c, st, w, remaining) > clover_chain_rate(c, st, best, remaining)) {
            best = w;
        }
    }
    return best;
}

// the chain width for the next round: best steady expected tokens per ms, sticky within CLOVER_SWITCH_GAIN
int32_t clover_chain_width(const clover_pass_costs & c, const clover_auto_state & st, int32_t w_max, int32_t remaining) {
    auto rate = [&](int32_t w) { return clover_chain_rate(c, st, w, remaining); };
    int32_t best = 1;
    if (w_max >= 2) {
        const int32_t wide = clover_best_chain_width(c, st, 2, w_max, remaining);
        if (rate(wide) > rate(best)) {
            best = wide;
        }
    }
    if (st.width >= 1 && st.width <= w_max && best != st.width && rate(best) < CLOVER_SWITCH_GAIN * rate(st.width)) {
        best = st.width;
    }
    return best;
}

// a block round's width and expected rate (0 when no width beats the chain's rate)
int32_t clover_block_width_for(const clover_pass_costs & c, const clover_auto_state & st, int32_t w_max,
                               int32_t remaining, double chain_rate) {
    int32_t best = 0;
    double best_rate = chain_rate;
    for (int32_t w = 2; w <= w_max; ++w) {
        const double tokens = clover_expected_tokens([&](int32_t k) { return st.block_rate.q(k); }, std::min(w, remaining));
        const double rate = tokens / (clover_block_ms(c, w) + clover_chain_ms(c, w) + c.rebuild_ms);
        if (rate > best_rate) {
            best = w;
            best_rate = rate;
        }
    }
    return best;
}

// after a block draft: the verification width with the best expected tokens per ms, given the confidence of
// each draft (the draft stops where the model doubts it); without the graph cache the pass after a block pass
// rebuilds its graph
int32_t clover_verify_width(const clover_pass_costs & c, const std::vector<double> & conf, int32_t remaining) {
    int32_t width = 1;
    double  best  = 0.0;
    for (int32_t w = 1; w <= (int32_t) conf.size(); ++w) {
        const double rate = clover_expected_tokens([&](int32_t k) { return conf[k - 1]; }, std::min(w, remaining)) /
                            (clover_chain_ms(c, w) + c.rebuild_ms);
        if (rate > best) {
            best  = rate;
            width = w;
        }
    }
    return width;
}

} // namespace

namespace {

// a pass another slot's rows shared times the round, not this slot's pass
bool clover_runs_alone(const clover_slot * slot) {
    return slot->shared == nullptr || slot->shared->n_generating <= 1;
}

// what one round's passes took, for the correction: ms of its causal and of its block passes
struct clover_round_clock {
    const clover_stats & stats;
    double causal_ms0;
    double block_ms0;

    explicit clover_round_clock(const clover_stats & s) : stats(s), causal_ms0(s.t_causal_ms), block_ms0(s.t_block_ms) {}

    double causal_ms() const { return stats.t_causal_ms - causal_ms0; }
    double  block_ms() const { return stats.t_block_ms - block_ms0; }
};

// One pass of each round is observed: an ar step, a chain pass, or a block round's block pass (the verification
// after it reads other memory than a chain pass). The table prices passes in a run of same-width passes; a pass
// after one of another width is slower than that (a graph switch, colder caches), so such an isolated pass, as a
// probe is, counts only when it shows the table too dear, never when it shows it too cheap: otherwise probes would
// price chains up, and the fewer chains run, the more isolated the next probe.
void clover_correct_costs(clover_cost_correction & correction, const clover_pass_costs & table,
                          const clover_round_clock & clock, clover_draft_kind kind, int32_t width, int32_t prev_width,
                          int32_t block_w) {
    const double ms = clock.causal_ms();
    const bool   steady = width == prev_width;
    switch (kind) {
        case CLOVER_DRAFT_NONE:
            if (steady || ms < table.ar_ms) {
                correction.ar.observe(ms, table.ar_ms);
            }
            break;
        case CLOVER_DRAFT_NGRAM:
            if (steady || ms < clover_chain_ms(table, width)) {
                correction.chain.observe(ms, clover_chain_ms(table, width));
            }
            break;
        case CLOVER_DRAFT_BLOCK:  // chosen on its merits (block rounds are not probed)
            correction.block.observe(clock.block_ms(), clover_block_ms(table, block_w));
            break;
        default: break;
    }
}

} // namespace

bool clover_run_auto(clover_run & run) {
    clover_slot * slot = run.slot;
    // a change of pass shape costs a rebuild only without the graph cache: with it, the few shapes auto
    // alternates between (chain widths, block windows, verifications) are each built once
    clover_pass_costs table = slot->costs;
    if (llama_get_graph_cache_size(slot->ctx) > 0) {
        table.rebuild_ms = 0.0f;
    }
    const bool adaptive = slot->costs_adaptive;
    clover_auto_state st;

    while (run.remaining() > 0) {
        const int32_t w_max = std::min({ run.block_size, slot->max_block_size, slot->n_ctx - slot->n_past });
        if (w_max < 1) {
            run.stats->stop_reason = CLOVER_STOP_CONTEXT;
            break;
        }
        const clover_pass_costs c = adaptive ? slot->feedback.correction.apply(table) : table;
        const int32_t remaining = run.remaining();
        // where the history holds no n-gram draft, a chain round would verify padding: the chain is an ar step
        const std::vector<llama_token> ngram = w_max > 1 ? clover_ngram_draft(slot, w_max - 1) : std::vector<llama_token>();
        int32_t width = ngram.empty() ? 1 : clover_chain_width(c, st, w_max, remaining);
        if (width > 1) {
            slot->feedback.chain_probe.chosen();
        } else if (adaptive && !ngram.empty() && w_max > 1 && slot->feedback.chain_probe.due(clover_cost_ratio::MIN)) {
            width = clover_best_chain_width(c, st, 2, w_max, remaining);
            slot->feedback.chain_probe.probed(clover_cost_ratio::MIN);
        }
        const double chain_rate = clover_expected_tokens([&](int32_t k) { return st.chain_rate.q(k); }, std::min(width, remaining)) /
                                  (clover_chain_ms(c, width) + (width == st.width ? 0.0 : c.rebuild_ms));
        // a file without block passes (trunk-only, or no mask token) drafts from n-grams only
        // Block rounds are not probed: on the demo model a probe's block window is a new pass shape whose graph
        // evicts the chains' kept ones, and six probes cost auto a quarter of its speed (bench_drafts, Q4_K_M).
        const int32_t block_w = slot->can_block ? clover_block_width_for(c, st, w_max, remaining, chain_rate) : 0;

        std::vector<llama_token> drafts;
        clover_draft_kind kind = width > 1 ? CLOVER_DRAFT_NGRAM : CLOVER_DRAFT_NONE;
        int32_t n_from_ngram = 0;  // a block round's drafts that came from the n-gram draft it extends
        const clover_round_clock clock(*run.stats);
        const int32_t prev_width = st.width;
        if (block_w > 0) {
            std::vector<double> conf;
            if (!clover_block_draft(run, block_w, ngram, st.chain_rate, drafts, conf)) {
                return false;
            }
            n_from_ngram = std::min((int32_t) ngram.size(), block_w - 1);
            width = clover_verify_width(c, conf, remaining);
            kind  = CLOVER_DRAFT_BLOCK;
        } else if (width > 1) {
            drafts.assign(ngram.begin(), ngram.begin() + std::min((int32_t) ngram.size(), width - 1));
            drafts.resize(width - 1, slot->pending);  // a short draft is padded: the chain keeps its shape
        } else if (st.shadow.draft.empty() && !ngram.empty()) {
            st.shadow.draft.assign(ngram.begin(), ngram.begin() + std::min((int32_t) ngram.size(), CLOVER_SHADOW_LEN));
        }

        clover_round round;
        if (!clover_verify(run, drafts.data(), std::min((int32_t) drafts.size(), width), width, round)) {
            return false;
        }
        if (adaptive && clover_runs_alone(slot)) {
            clover_correct_costs(slot->feedback.correction, table, clock, kind, width, prev_width, block_w);
        }
        run.stats->auto_rounds[kind]++;
        run.stats->auto_drafted  += round.n_compared;
        run.stats->auto_accepted += round.n_accepted;
        clover_histogram_add(run.stats->accepted_lengths, round.m);
        if (kind == CLOVER_DRAFT_BLOCK) {
            run.stats->auto_accepted_block += std::max(0, round.n_accepted - n_from_ngram);
            st.block_rate.add(round);
            st.width = 0;
        } else if (kind == CLOVER_DRAFT_NGRAM) {
            st.chain_rate.add(round);
            st.shadow = {};
            st.width  = width;
        } else {
            st.shadow.observe(slot->pending, st.chain_rate);  // the ar step's token is the new pending token
            st.width = 1;
        }
        if (round.hit_eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            break;
        }
    }
    if (run.stats->stop_reason == CLOVER_STOP_NONE) {
        run.stats->stop_reason = CLOVER_STOP_LENGTH;
    }
    if (adaptive) {
        run.stats->costs = slot->feedback.correction.apply(slot->costs);  // the table the last decision used
    }
    return true;
}

//
// the cost table
//

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
        if (!slot->can_block) {  // no block passes to measure: auto never drafts with them on this file
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
