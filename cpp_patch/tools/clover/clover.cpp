// Clover decoding engine: ar, LowConfidence block diffusion and self-speculative decoding
// (shared/clover-spec.md section 4). See clover.h for the API and docs/decoding.md for the reading of the spec
// that the PyTorch reference (clover_ref/decode.py) implements; in greedy mode this engine is token-identical to it.

#include "clover.h"
#include "clover-cpp.h"
#include "clover-impl.h"
#include "clover-log.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "llama.h"
#include "llama-cpp.h"

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <vector>

//
// helpers
//

static void clover_set_err(char * err, size_t err_size, const std::string & msg) {
    if (err && err_size > 0) {
        snprintf(err, err_size, "%s", msg.c_str());
    }
}

static std::string clover_vformat(const char * fmt, va_list args) {
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, args);
    return buf;
}

std::string clover_format(const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::string out = clover_vformat(fmt, args);
    va_end(args);
    return out;
}

void clover_log(ggml_log_level level, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    const std::string buf = clover_vformat(fmt, args);
    va_end(args);
    ggml_log_callback cb = nullptr;
    void * user_data = nullptr;
    llama_log_get(&cb, &user_data);
    if (cb) {
        cb(level, buf.c_str(), user_data);
    } else {
        fputs(buf.c_str(), stderr);
    }
}

double clover_now_ms() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

void clover_histogram_add(int32_t * histogram, int32_t value) {
    histogram[std::min(std::max(value, 0), CLOVER_HIST_SIZE - 1)]++;
}

//
// batches and passes
//

static void clover_batch_fill(llama_batch & batch, const llama_token * tokens, int32_t n, llama_pos pos0,
                              llama_seq_id seq, const std::vector<int32_t> & rows) {
    batch.n_tokens = n;
    for (int32_t i = 0; i < n; ++i) {
        batch.token[i]     = tokens[i];
        batch.pos[i]       = pos0 + i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i]    = 0;
    }
    for (int32_t r : rows) {
        batch.logits[r] = 1;
    }
}

static bool clover_decode(clover_engine * eng, const char * what) {
    const int32_t rc = eng->shared ? clover_parallel_pass(eng, false) : llama_decode(eng->ctx, eng->batch);
    if (rc != 0) {
        eng->last_error = clover_format("llama_decode failed in the %s (code %d)", what, rc);
        return false;
    }
    return true;
}

// causal pass appending tokens to the history (seq 0) at positions n_past ..; logits for rows
static bool clover_causal(clover_engine * eng, const llama_token * tokens, int32_t n,
                          const std::vector<int32_t> & rows, const char * what) {
    if (n > eng->batch_cap) {
        eng->last_error = clover_format("internal error: a causal pass of %d tokens exceeds the batch (%d)", n, eng->batch_cap);
        return false;
    }
    clover_batch_fill(eng->batch, tokens, n, eng->n_past, eng->seq_history, rows);
    if (!clover_decode(eng, what)) {
        return false;
    }
    eng->n_past += n;
    eng->history.insert(eng->history.end(), tokens, tokens + n);
    return true;
}

// forget history positions [keep, n_past): the recurrent state rolls back within n_rs_seq positions
static bool clover_rollback(clover_engine * eng, int32_t keep) {
    if (keep < eng->n_past && !llama_memory_seq_rm(eng->mem, eng->seq_history, keep, -1)) {
        eng->last_error = clover_format("rollback of positions %d .. %d refused (n_rs_seq = %u)",
                keep, eng->n_past - 1, llama_n_rs_seq(eng->ctx));
        return false;
    }
    eng->n_past = std::min(eng->n_past, keep);
    eng->history.resize(eng->n_past);
    clover_cache_forget_after(eng, eng->n_past);
    return true;
}

// block pass over the window at positions n_past .. on a scratch copy of the history; logits for rows.
// The history (seq 0) is never written.
bool clover_block(clover_engine * eng, const std::vector<llama_token> & window, const std::vector<int32_t> & rows) {
    const int32_t n = (int32_t) window.size();
    if (n > eng->max_block_size || n > eng->batch_cap) {
        eng->last_error = clover_format("internal error: a block window of %d exceeds max_block_size %d", n, eng->max_block_size);
        return false;
    }
    if (!eng->can_block) {
        eng->last_error = eng->block_unavailable;
        return false;
    }
    clover_batch_fill(eng->batch, window.data(), n, eng->n_past, eng->seq_scratch, rows);
    if (!eng->shared) {
        llama_clover_set_coreset_top_p(eng->model, eng->coreset_top_p);
    }
    const int32_t rc = eng->shared ? clover_parallel_pass(eng, true)
                                   : clover_block_decode_seqs(eng->ctx, eng->batch, &eng->seq_history, &eng->seq_scratch, 1);
    if (rc != 0) {
        eng->last_error = clover_format("llama_decode failed in the block pass (code %d)", rc);
        return false;
    }
    return true;
}

//
// distributions (spec 4, "Distributions and confidence")
//


// float32 logits of batch row i (NULL with last_error set when llama.cpp has none)
const float * clover_get_row(clover_engine * eng, int32_t i) {
    const float * logits = nullptr;
    if (!eng->shared) {
        logits = llama_get_logits_ith(eng->ctx, i);
    } else if (i >= 0 && i < (int32_t) eng->row_of.size() && eng->row_of[i] >= 0) {
        logits = eng->rows.data() + (size_t) eng->row_of[i] * eng->n_vocab;  // copied out by the round
    }
    if (!logits) {
        eng->last_error = clover_format("llama_get_logits_ith(%d) returned no logits", i);
    }
    return logits;
}


llama_token clover_argmax(const clover_sampler & smp, const float * logits, int32_t n_vocab) {
    llama_token best = -1;
    float       best_v = -std::numeric_limits<float>::infinity();
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (smp.excluded[i]) {
            continue;
        }
        if (best < 0 || logits[i] > best_v) {
            best   = i;
            best_v = logits[i];
        }
    }
    return best < 0 ? 0 : best;
}

// P(token) with excluded ids at -inf, softmax at temperature 1 (float32 result)
float clover_prob(const clover_sampler & smp, const float * logits, int32_t n_vocab, llama_token token, float max_v) {
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (!smp.excluded[i]) {
            sum += std::exp((double) logits[i] - (double) max_v);
        }
    }
    return (float) (std::exp((double) logits[token] - (double) max_v) / sum);
}

// Q: P after temperature, top-k, top-p; written to smp.probs (n_vocab doubles, zero outside the support)
static void clover_sampling_dist(clover_sampler & smp, const float * logits, int32_t n_vocab) {
    std::vector<double> & q = smp.probs;
    q.assign(n_vocab, 0.0);
    if (smp.greedy()) {
        q[clover_argmax(smp, logits, n_vocab)] = 1.0;
        return;
    }
    float max_v = -std::numeric_limits<float>::infinity();
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (!smp.excluded[i]) {
            max_v = std::max(max_v, logits[i]);
        }
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (!smp.excluded[i]) {
            q[i] = std::exp(((double) logits[i] - (double) max_v) / (double) smp.temperature);
            sum += q[i];
        }
    }
    for (auto & v : q) {
        v /= sum;
    }
    if (smp.top_k > 0 && smp.top_k < n_vocab) {
        std::vector<double> tmp(q);
        std::nth_element(tmp.begin(), tmp.begin() + (smp.top_k - 1), tmp.end(), std::greater<double>());
        const double cutoff = tmp[smp.top_k - 1];
        sum = 0.0;
        for (auto & v : q) {
            if (v < cutoff) {
                v = 0.0;
            }
            sum += v;
        }
        for (auto & v : q) {
            v /= sum;
        }
    }
    if (smp.top_p < 1.0f) {
        auto & order = smp.order;
        order.clear();
        for (int32_t i = 0; i < n_vocab; ++i) {
            if (q[i] > 0.0) {
                order.push_back(i);
            }
        }
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return q[a] > q[b]; });
        double before = 0.0;
        size_t n_keep = 0;
        for (; n_keep < order.size(); ++n_keep) {
            if (!(before < (double) smp.top_p)) {
                break;
            }
            before += q[order[n_keep]];
        }
        n_keep = std::max<size_t>(n_keep, 1);
        sum = 0.0;
        for (size_t k = 0; k < order.size(); ++k) {
            if (k < n_keep) {
                sum += q[order[k]];
            } else {
                q[order[k]] = 0.0;
            }
        }
        for (auto & v : q) {
            v /= sum;
        }
    }
}

static llama_token clover_draw(clover_sampler & smp, const std::vector<double> & q) {
    double total = 0.0;
    for (double v : q) {
        total += v;
    }
    const double u = smp.uniform() * total;
    double acc = 0.0;
    llama_token last = -1;
    for (size_t i = 0; i < q.size(); ++i) {
        if (q[i] <= 0.0) {
            continue;
        }
        acc += q[i];
        last = (llama_token) i;
        if (u < acc) {
            return last;
        }
    }
    return last < 0 ? 0 : last;
}

// a target's token and its confidence P(token) at temperature 1
struct clover_choice {
    llama_token token;
    float       conf;
};

// the token for one target (greedy: argmax P; else a draw from Q) and its confidence P(token)
static clover_choice clover_choose(clover_engine * eng, clover_sampler & smp, const float * logits) {
    const int32_t n_vocab = eng->n_vocab;
    const llama_token best = clover_argmax(smp, logits, n_vocab);
    const float max_v = logits[best];
    llama_token token = best;
    if (!smp.greedy()) {
        clover_sampling_dist(smp, logits, n_vocab);
        token = clover_draw(smp, smp.probs);
    }
    return { token, clover_prob(smp, logits, n_vocab, token, max_v) };
}

//
// one generate call
//

static bool clover_emit(clover_run & run, const llama_token * tokens, int32_t n) {
    if (n <= 0) {
        return true;
    }
    run.n_out += n;
    run.stats->n_generated = run.n_out;
    bool go_on = true;
    if (run.on_tokens) {
        clover_callback_scope unlocked(run.eng);
        go_on = run.on_tokens(tokens, n, run.user_data);
    }
    if (!go_on) {
        run.cancelled = true;
        return false;
    }
    return true;
}

// window width for the next block: B, or what is left of the context (spec 4.1); 0 ends generation
static int32_t clover_block_width(clover_run & run) {
    const int32_t width = std::min(run.block_size, run.eng->n_ctx - run.eng->n_past);
    if (width < 1) {
        run.stats->stop_reason = CLOVER_STOP_CONTEXT;
        return 0;
    }
    return width;
}

bool clover_timed_block(clover_run & run, const std::vector<llama_token> & window, const std::vector<int32_t> & rows) {
    const double t0 = clover_now_ms();
    const bool ok = clover_block(run.eng, window, rows);
    run.stats->t_block_ms += clover_now_ms() - t0;
    run.stats->n_block_passes++;
    return ok;
}

static bool clover_timed_causal(clover_run & run, const llama_token * tokens, int32_t n, const std::vector<int32_t> & rows, const char * what) {
    const double t0 = clover_now_ms();
    const bool ok = clover_causal(run.eng, tokens, n, rows, what);
    run.stats->t_causal_ms += clover_now_ms() - t0;
    run.stats->n_causal_passes++;
    return ok;
}

void clover_window(const clover_run & run, const std::vector<llama_token> & canvas, std::vector<llama_token> & window) {
    const int32_t w = (int32_t) canvas.size();
    window.resize(w);
    window[0] = run.eng->pending;
    for (int32_t j = 0; j + 1 < w; ++j) {
        window[j + 1] = canvas[j] == CLOVER_EMPTY ? run.eng->info.mask_token_id : canvas[j];
    }
}

// one LowConfidence step: a block pass; fill every masked target above the threshold, or the single most
// confident one (ties to the lowest position). Returns false on error or cancellation.
static bool clover_step(clover_run & run, std::vector<llama_token> & canvas) {
    clover_engine * eng = run.eng;
    std::vector<int32_t> masked;
    for (int32_t j = 0; j < (int32_t) canvas.size(); ++j) {
        if (canvas[j] == CLOVER_EMPTY) {
            masked.push_back(j);
        }
    }
    std::vector<llama_token> window;
    clover_window(run, canvas, window);
    if (!clover_timed_block(run, window, masked)) {
        return false;
    }
    std::vector<clover_choice> choices;
    choices.reserve(masked.size());
    for (int32_t j : masked) {
        const float * logits = clover_get_row(eng, j);
        if (!logits) {
            return false;
        }
        choices.push_back(clover_choose(eng, run.smp, logits));
    }
    const float threshold = run.threshold;
    bool any = false;
    for (size_t i = 0; i < masked.size(); ++i) {
        if (choices[i].conf > threshold) {
            canvas[masked[i]] = choices[i].token;
            any = true;
        }
    }
    if (!any && !masked.empty()) {
        size_t best = 0;
        for (size_t i = 1; i < masked.size(); ++i) {
            if (choices[i].conf > choices[best].conf) {
                best = i;
            }
        }
        canvas[masked[best]] = choices[best].token;
    }
    if (run.on_step) {
        std::vector<llama_token> view(canvas.size());
        for (size_t j = 0; j < canvas.size(); ++j) {
            view[j] = canvas[j] == CLOVER_EMPTY ? eng->info.mask_token_id : canvas[j];
        }
        bool go_on = true;
        {
            clover_callback_scope unlocked(eng);
            go_on = run.on_step(view.data(), (int32_t) view.size(), run.user_data);
        }
        if (!go_on) {
            run.cancelled = true;
            return false;
        }
    }
    return true;
}

// min(K, R) of spec 4.1, and the 1-based offset of the end-of-generation target that set K (0 if none)
static int32_t clover_produced_limit(const clover_run & run, const std::vector<llama_token> & canvas, int32_t & eog_at) {
    eog_at = 0;
    const int32_t remaining = run.remaining();
    for (int32_t j = 1; j <= (int32_t) canvas.size(); ++j) {
        const llama_token t = canvas[j - 1];
        if (t == CLOVER_EMPTY) {
            break;
        }
        if (run.is_stop(t)) {
            eog_at = j;
            return std::min(j, remaining);
        }
    }
    return std::min((int32_t) canvas.size(), remaining);
}

static bool clover_run_ar(clover_run & run) {
    while (run.remaining() > 0) {
        if (run.eng->n_past >= run.eng->n_ctx) {
            run.stats->stop_reason = CLOVER_STOP_CONTEXT;
            return true;
        }
        clover_round round;
        if (!clover_verify(run, nullptr, 0, 1, round)) {  // a width-1 verification without drafts: an ar step
            return false;
        }
        if (round.hit_eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            return true;
        }
    }
    run.stats->stop_reason = CLOVER_STOP_LENGTH;
    return true;
}

static bool clover_run_diffusion(clover_run & run) {
    clover_engine * eng = run.eng;
    while (run.remaining() > 0) {
        const int32_t width = clover_block_width(run);
        if (width == 0) {
            return true;
        }
        std::vector<llama_token> canvas(width, CLOVER_EMPTY);
        int32_t steps  = 0;
        int32_t limit  = 0;
        int32_t eog_at = 0;
        while (true) {
            limit = clover_produced_limit(run, canvas, eog_at);
            bool filled = true;
            for (int32_t j = 0; j < limit; ++j) {
                filled = filled && canvas[j] != CLOVER_EMPTY;
            }
            if (filled) {
                break;
            }
            if (!clover_step(run, canvas)) {
                return false;
            }
            steps++;
        }
        clover_histogram_add(run.stats->steps_per_block, steps);

        // commit: causal pass over [pending, produced[:-1]]; the last produced token becomes the pending token
        std::vector<llama_token> commit(limit);
        commit[0] = eng->pending;
        for (int32_t j = 0; j + 1 < limit; ++j) {
            commit[j + 1] = canvas[j];
        }
        if (!clover_timed_causal(run, commit.data(), limit, {}, "commit pass")) {
            return false;
        }
        eng->pending = canvas[limit - 1];
        if (eog_at == limit) {
            if (!clover_emit(run, canvas.data(), limit - 1)) {
                return false;
            }
            run.stats->stop_reason = CLOVER_STOP_EOG;
            return true;
        }
        if (!clover_emit(run, canvas.data(), limit)) {
            return false;
        }
    }
    run.stats->stop_reason = CLOVER_STOP_LENGTH;
    return true;
}

// draft: draft_steps LowConfidence steps, then one block pass where every still-masked target takes argmax P
static bool clover_draft(clover_run & run, int32_t width, std::vector<llama_token> & canvas) {
    clover_engine * eng = run.eng;
    canvas.assign(width, CLOVER_EMPTY);
    for (int32_t s = 0; s < run.params->draft_steps; ++s) {
        if (std::find(canvas.begin(), canvas.end(), CLOVER_EMPTY) == canvas.end()) {
            break;
        }
        if (!clover_step(run, canvas)) {
            return false;
        }
    }
    std::vector<int32_t> masked;
    for (int32_t j = 0; j < width; ++j) {
        if (canvas[j] == CLOVER_EMPTY) {
            masked.push_back(j);
        }
    }
    if (masked.empty()) {
        return true;
    }
    std::vector<llama_token> window;
    clover_window(run, canvas, window);
    if (!clover_timed_block(run, window, masked)) {
        return false;
    }
    for (int32_t j : masked) {
        const float * logits = clover_get_row(eng, j);
        if (!logits) {
            return false;
        }
        canvas[j] = clover_argmax(run.smp, logits, eng->n_vocab);
    }
    return true;
}

// The token of one verified target and whether its draft was accepted (draft < 0: none). Greedy: argmax P,
// accepted when it equals the draft; sampling: the draft with probability Q(d), else a draw from Q without d.
static llama_token clover_accept(clover_run & run, const float * logits, llama_token draft, bool & accepted) {
    const int32_t n_vocab = run.eng->n_vocab;
    if (run.smp.greedy()) {
        const llama_token token = clover_argmax(run.smp, logits, n_vocab);
        accepted = draft >= 0 && token == draft;
        return token;
    }
    clover_sampling_dist(run.smp, logits, n_vocab);
    accepted = draft >= 0 && run.smp.uniform() < run.smp.probs[draft];
    if (accepted) {
        return draft;
    }
    if (draft >= 0) {
        run.smp.probs[draft] = 0.0;
    }
    return clover_draw(run.smp, run.smp.probs);
}

// Verification and acceptance (spec 4.2, steps 2-4): one causal pass over [pending, drafts[0 .. width-2]] with all
// width rows; output a_j is compared with draft d_j (j <= n_drafts; a missing draft is never accepted, so all
// drafts accepted gives a_{n_drafts+1} as a free token). m = min(c+1, width, R, first end-of-generation); emits
// a_1 .. a_m but an end-of-generation token, keeps history through p+m-1, and a_m becomes the pending token. With
// width 1 and no draft this is exactly an ar step.
bool clover_verify(clover_run & run, const llama_token * drafts, int32_t n_drafts, int32_t width, clover_round & round) {
    clover_engine * eng = run.eng;
    const int32_t p = eng->n_past;
    std::vector<llama_token> inputs(width);
    std::vector<int32_t>     rows(width);
    inputs[0] = eng->pending;
    for (int32_t j = 0; j < width; ++j) {
        rows[j] = j;
        if (j + 1 < width) {
            inputs[j + 1] = drafts[j];
        }
    }
    if (!clover_timed_causal(run, inputs.data(), width, rows, width == 1 ? "ar step" : "verification pass")) {
        return false;
    }
    round = {};
    std::vector<llama_token> out;
    llama_token next_pending = eng->pending;
    for (int32_t j = 1; j <= width; ++j) {
        const float * logits = clover_get_row(eng, j - 1);
        if (!logits) {
            return false;
        }
        bool accepted = false;
        const llama_token token = clover_accept(run, logits, j <= n_drafts ? drafts[j - 1] : -1, accepted);
        round.m           = j;
        round.n_accepted += accepted ? 1 : 0;
        next_pending         = token;
        if (run.is_stop(token)) {
            round.hit_eog = true;
            break;
        }
        out.push_back(token);
        if (!accepted || j == width || (int32_t) out.size() == run.remaining()) {
            break;
        }
    }
    round.n_compared = std::min(round.m, n_drafts);

    // keep history through p+m-1, roll back p+m .. p+width-1; a_{p+m} is the next pending token
    if (!clover_rollback(eng, p + round.m)) {
        return false;
    }
    eng->pending = next_pending;
    return clover_emit(run, out.data(), (int32_t) out.size());
}

static bool clover_run_spec(clover_run & run) {
    std::vector<llama_token> drafts;
    while (run.remaining() > 0) {
        const int32_t width = clover_block_width(run);
        if (width == 0) {
            return true;
        }
        if (!clover_draft(run, width, drafts)) {
            return false;
        }
        clover_round round;
        if (!clover_verify(run, drafts.data(), width, width, round)) {
            return false;
        }
        clover_histogram_add(run.stats->accepted_lengths, round.m);
        if (round.hit_eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            return true;
        }
    }
    run.stats->stop_reason = CLOVER_STOP_LENGTH;
    return true;
}

//
// clover_generate: validation, sampler set-up, prefill, dispatch
//

// the block size and threshold a call uses (spec 4.3), or an error message
static bool clover_resolve_params(const clover_engine * eng, const clover_gen_params * params, int32_t & block_size,
                                  float & threshold, std::string & err) {
    if (params->mode < CLOVER_MODE_AR || params->mode > CLOVER_MODE_AUTO) {
        err = clover_format("unknown mode %d (0 = ar, 1 = diffusion, 2 = spec, 3 = auto)", params->mode);
        return false;
    }
    if (params->block_size < 0) {
        err = clover_format("block size must be at least 1, got %d", params->block_size);
        return false;
    }
    block_size = params->block_size > 0 ? params->block_size : eng->info.block_size;
    if (block_size > eng->max_block_size) {
        err = clover_format("block size %d exceeds this engine's max_block_size %d (set max_block_size when loading)",
                block_size, eng->max_block_size);
        return false;
    }
    threshold = params->threshold;
    if (std::isnan(threshold) || threshold > 1.0f) {
        err = clover_format("threshold must be in [0, 1] (or negative for the calibrated default), got %g", (double) threshold);
        return false;
    }
    if (threshold < 0.0f) {
        threshold = clover_info_threshold(&eng->info, block_size);
        const int32_t * sizes = eng->info.calibrated_block_sizes;
        const bool calibrated = std::find(sizes, sizes + eng->info.n_calibrated, block_size) != sizes + eng->info.n_calibrated;
        if (!calibrated && params->mode != CLOVER_MODE_AR && params->mode != CLOVER_MODE_AUTO) {
            clover_log(GGML_LOG_LEVEL_WARN, "clover: block size %d is not among the calibrated sizes; using the default threshold %g\n",
                    block_size, (double) eng->info.threshold);
        }
    }
    return true;
}

// everything about a call's parameters that does not depend on the model, and the prompt's ids
static bool clover_check_params(const clover_engine * eng, const clover_gen_params * params, const llama_token * prompt,
                                int32_t n_prompt, std::string & err) {
    if (!prompt || n_prompt <= 0) {
        err = "the prompt is empty; at least one token is needed (the last one is the pending token)";
        return false;
    }
    for (int32_t i = 0; i < n_prompt; ++i) {
        if (prompt[i] < 0 || prompt[i] >= eng->n_vocab) {
            err = clover_format("prompt token %d at index %d is outside the vocabulary (%d)", prompt[i], i, eng->n_vocab);
            return false;
        }
    }
    if (params->max_tokens < 0) {
        err = clover_format("max_tokens must not be negative, got %d", params->max_tokens);
    } else if (!(params->temperature >= 0.0f) || std::isinf(params->temperature)) {
        err = clover_format("temperature must be a finite number >= 0, got %g", (double) params->temperature);
    } else if (params->top_k < 0) {
        err = clover_format("top_k must be >= 0 (0 = off), got %d", params->top_k);
    } else if (!(params->top_p > 0.0f && params->top_p <= 1.0f)) {
        err = clover_format("top_p must be in (0, 1], got %g", (double) params->top_p);
    } else if (params->draft_steps < 0) {
        err = clover_format("draft_steps must be >= 0, got %d", params->draft_steps);
    } else if (params->draft_steps > 0 && params->temperature > 0.0f) {
        err = "draft_steps applies to greedy decoding only (temperature 0)";
    } else if (params->n_stop_ids > 0 && !params->stop_ids) {
        err = "stop_ids is NULL while n_stop_ids > 0";
    } else if (params->n_banned_ids > 0 && !params->banned_ids) {
        err = "banned_ids is NULL while n_banned_ids > 0";
    }
    return err.empty();
}

// what needs block passes (spec 5, "Files"): diffusion and spec need the block-diffusion tensors and a mask token
// (auto then drafts from n-grams only); the coreset top_p of the call's block passes
static bool clover_check_block_params(const clover_engine * eng, const clover_gen_params * params, float & coreset_top_p,
                                      std::string & err) {
    if (std::isnan(params->coreset_top_p) || params->coreset_top_p > 1.0f) {
        err = clover_format("coreset_top_p must be in (0, 1] (or <= 0 for the GGUF's value), got %g",
                (double) params->coreset_top_p);
        return false;
    }
    coreset_top_p = params->coreset_top_p > 0.0f ? params->coreset_top_p : eng->info.coreset_top_p;
    if ((params->mode == CLOVER_MODE_DIFFUSION || params->mode == CLOVER_MODE_SPEC) && !eng->can_block) {
        err = eng->block_unavailable;
        return false;
    }
    return true;
}

// flags[t] = 1 for each of the n ids; an id outside the vocabulary is an error naming `what`
static bool clover_mark_ids(const clover_engine * eng, const llama_token * ids, int32_t n, const char * what,
                            std::vector<uint8_t> & flags, std::string & err) {
    for (int32_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= eng->n_vocab) {
            err = clover_format("%s id %d is outside the vocabulary (%d)", what, ids[i], eng->n_vocab);
            return false;
        }
        flags[ids[i]] = 1;
    }
    return true;
}

// banned and stop ids, temperature, top-k/p and the seeded RNG
static bool clover_init_sampler(const clover_engine * eng, const clover_gen_params * params, clover_sampler & smp,
                                std::string & err) {
    smp.excluded.assign(eng->n_vocab, 0);
    if (eng->info.mask_token_id >= 0) {
        smp.excluded[eng->info.mask_token_id] = 1;
    }
    if (!clover_mark_ids(eng, params->banned_ids, params->n_banned_ids, "banned", smp.excluded, err)) {
        return false;
    }
    if (std::find(smp.excluded.begin(), smp.excluded.end(), 0) == smp.excluded.end()) {
        err = "every token is banned";
        return false;
    }
    smp.stop.assign(eng->n_vocab, 0);
    const bool vocab_eog = params->n_stop_ids < 0;
    if (!clover_mark_ids(eng, vocab_eog ? eng->eog_ids.data() : params->stop_ids,
                         vocab_eog ? (int32_t) eng->eog_ids.size() : params->n_stop_ids, "stop", smp.stop, err)) {
        return false;
    }
    smp.temperature = params->temperature;
    smp.top_k       = params->top_k;
    smp.top_p       = params->top_p;
    smp.rng.seed(params->seed);
    return true;
}

// causal pass over [old pending token, prompt[0 .. n-2]] in n_batch chunks; prompt[n-1] becomes the pending token
static bool clover_prefill(clover_engine * eng, const llama_token * prompt, int32_t n_prompt, clover_stats * stats) {
    std::vector<llama_token> pending;
    pending.reserve(n_prompt);
    if (eng->has_pending) {
        pending.push_back(eng->pending);
    }
    pending.insert(pending.end(), prompt, prompt + n_prompt - 1);
    if ((int64_t) eng->n_past + (int64_t) pending.size() + 1 > eng->n_ctx) {
        eng->last_error = clover_format("the prompt needs %lld positions, more than the context size %d",
                (long long) eng->n_past + (long long) pending.size() + 1, eng->n_ctx);
        return false;
    }
    const double t0 = clover_now_ms();
    for (size_t i = 0; i < pending.size();) {
        int32_t n = (int32_t) std::min<size_t>(eng->n_batch, pending.size() - i);
        // chunks end where a checkpoint is due (clover-cache.cpp)
        const int32_t due = clover_cache_next_due(eng);
        if (due > eng->n_past && due < eng->n_past + n) {
            n = due - eng->n_past;
        }
        if (!clover_causal(eng, pending.data() + i, n, {}, "prefill")) {
            eng->last_error += "; the engine was reset";
            clover_engine_reset(eng);
            return false;
        }
        i += n;
        if (eng->n_past == due) {
            clover_cache_save(eng);
        }
    }
    clover_cache_save(eng);  // where the answer starts
    stats->t_prefill_ms = clover_now_ms() - t0;
    eng->pending     = prompt[n_prompt - 1];
    eng->has_pending = true;
    return true;
}

static bool clover_dispatch(clover_run & run) {
    if (run.budget == 0) {
        run.stats->stop_reason = CLOVER_STOP_LENGTH;
        return true;
    }
    switch (run.params->mode) {
        case CLOVER_MODE_AR:        return clover_run_ar(run);
        case CLOVER_MODE_DIFFUSION: return clover_run_diffusion(run);
        case CLOVER_MODE_SPEC:      return clover_run_spec(run);
        default:
            if (!run.eng->has_costs && run.eng->shared && run.eng->shared->has_costs) {
                run.eng->costs     = run.eng->shared->costs;  // slots share one context: one table serves all
                run.eng->has_costs = true;
            }
            if (!run.eng->has_costs) {
                if (!clover_measure_costs(run.eng, run.eng->costs)) {
                    return false;
                }
                run.eng->has_costs = true;
                if (run.eng->shared) {
                    run.eng->shared->costs     = run.eng->costs;
                    run.eng->shared->has_costs = true;
                }
            }
            run.stats->costs = run.eng->costs;
            return clover_run_auto(run);
    }
}

//
// C API
//

static void clover_backend_init_once() {
    static std::once_flag flag;
    std::call_once(flag, [] { llama_backend_init(); });
}

static bool clover_has_gpu() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const auto type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return true;
        }
    }
    return false;
}

// everything clover_engine_load hands to llama.cpp, resolved from the engine params and the GGUF header;
// mparams points into offload, so a plan is not copied
struct clover_load_plan {
    clover_model_info    info = {};
    std::string          bd_path;  // the block-diffusion sidecar, or empty
    int32_t              max_block = 0;
    int32_t              n_ctx     = 0;
    int32_t              n_batch   = 0;
    int32_t              n_parallel = 1;
    clover_offload       offload;
    llama_model_params   mparams = {};
    llama_context_params cparams = {};

    clover_load_plan() = default;
    clover_load_plan(const clover_load_plan &) = delete;
    clover_load_plan & operator=(const clover_load_plan &) = delete;
};

static bool clover_make_load_plan(const char * path, const clover_engine_params & params, clover_load_plan & plan,
                                  std::string & err) {
    clover_model_info & info = plan.info;
    if (!clover_read_info(path, params.bd_path, info, err)) {
        return false;
    }
    if (params.n_ctx < 0 || params.n_batch < 0 || params.max_block_size < 0 || params.n_threads < 0) {
        err = "engine params must not be negative";
        return false;
    }
    const int32_t n_parallel = params.n_parallel > 0 ? params.n_parallel : 1;  // 0 = one slot
    if (n_parallel > 256) {
        err = clover_format("n_parallel %d must be in 1 .. 256", params.n_parallel);
        return false;
    }
    int32_t max_block = params.max_block_size;
    if (max_block == 0) {
        max_block = info.block_size;
        for (int32_t i = 0; i < info.n_calibrated; ++i) {
            max_block = std::max(max_block, info.calibrated_block_sizes[i]);
        }
    }
    if (max_block < 1 || max_block > 4096) {
        err = clover_format("max_block_size %d must be in 1 .. 4096", max_block);
        return false;
    }

    clover_backend_init_once();

    const int32_t n_layer = clover_gguf_n_layer(path, err);
    if (n_layer < 0 || !clover_offload_resolve(params, n_layer, plan.offload, err)) {
        return false;
    }
    plan.mparams = llama_model_default_params();
    plan.mparams.n_gpu_layers    = params.n_gpu_layers;
    plan.mparams.use_extra_bufts = params.use_extra_bufts;
    plan.offload.apply(plan.mparams);

    int32_t n_ctx = params.n_ctx;
    if (n_ctx == 0) {
        n_ctx = info.n_ctx_train > 0 ? std::min(info.n_ctx_train, 4096) : 4096;
    }
    // a non-causal window must fit one ubatch, and the hybrid memory's split keeps the trailing n_rs_seq + 1
    // tokens of a sequence in one ubatch, which needs n_ubatch > n_rs_seq + 1 = max_block
    const int32_t n_ubatch = std::max(max_block + 1, std::min(params.n_batch > 0 ? params.n_batch : 512, 512));
    const int32_t n_batch  = std::max(params.n_batch > 0 ? params.n_batch : 512, n_ubatch);

    llama_context_params & cparams = plan.cparams;
    cparams = llama_context_default_params();
    cparams.n_ctx      = std::max(n_ctx, n_batch);  // llama.cpp caps n_batch at n_ctx; the engine enforces n_ctx itself
    cparams.n_batch    = n_batch;
    cparams.n_ubatch   = n_ubatch;
    cparams.n_seq_max  = 2 * n_parallel;  // a history and a scratch sequence per slot
    cparams.kv_unified = true;
    cparams.n_rs_seq   = max_block - 1;
    cparams.no_perf    = true;
    const int32_t n_threads = params.n_threads > 0 ? params.n_threads : clover_default_n_threads();
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;

    if (n_ctx / n_parallel < 2) {
        err = clover_format("n_ctx %d leaves no room for %d slots (each slot gets n_ctx / n_parallel)", n_ctx, n_parallel);
        return false;
    }
    plan.bd_path    = params.bd_path ? params.bd_path : "";
    plan.max_block  = max_block;
    plan.n_ctx      = n_ctx / n_parallel;  // per slot, as llama-server divides -c among its -np slots
    plan.n_parallel = n_parallel;
    plan.n_batch   = n_batch;
    return true;
}

extern "C" {

int32_t clover_block_decode(struct llama_context * ctx, const struct llama_batch * batch) {
    if (!ctx || !batch) {
        return -1;
    }
    const llama_seq_id history = 0;  // a single-slot engine's sequences
    const llama_seq_id scratch = 1;
    return clover_block_decode_seqs(ctx, *batch, &history, &scratch, 1);
}

struct clover_engine_params clover_engine_default_params(void) {
    clover_engine_params p = {};
    p.n_ctx           = 0;
    p.n_batch         = 512;
    p.max_block_size  = 0;
    p.n_threads       = 0;
    p.n_gpu_layers    = 0;
    p.use_extra_bufts = true;
    p.override_tensor = nullptr;
    p.n_cpu_moe       = 0;
    p.cpu_moe         = false;
    p.split_mode      = -1;
    p.main_gpu        = 0;
    p.tensor_split    = nullptr;
    p.fit_margin_mib  = 1024;
    p.n_parallel      = 1;
    p.bd_path         = nullptr;
    return p;
}

struct clover_gen_params clover_gen_default_params(void) {
    clover_gen_params p = {};
    p.mode         = CLOVER_MODE_DIFFUSION;
    p.block_size   = 0;
    p.threshold    = -1.0f;
    p.draft_steps  = 0;
    p.temperature  = 0.0f;
    p.top_k        = 0;
    p.top_p        = 1.0f;
    p.seed         = 0;
    p.max_tokens   = 64;
    p.stop_ids     = nullptr;
    p.n_stop_ids   = -1;
    p.banned_ids   = nullptr;
    p.n_banned_ids = 0;
    p.coreset_top_p = 0.0f;
    return p;
}

int32_t clover_model_info_read(const char * path, const char * bd_path, struct clover_model_info * info, char * err,
                               size_t err_size) {
    if (!info) {
        clover_set_err(err, err_size, "info is NULL");
        return -1;
    }
    std::string msg;
    if (!clover_read_info(path, bd_path, *info, msg)) {
        clover_set_err(err, err_size, msg);
        return -1;
    }
    clover_set_err(err, err_size, "");
    return 0;
}

int32_t clover_read_model_info(const char * path, struct clover_model_info * info, char * err, size_t err_size) {
    return clover_model_info_read(path, nullptr, info, err, err_size);
}

// a plan that does not fit a GPU, or slots whose context does not fit host memory, is refused before loading,
// with the numbers, instead of failing in an allocation (or, on the host, being killed when the memory is touched)
static bool clover_check_plan_fits(const char * path, const clover_engine_params & params, const clover_load_plan & plan,
                                   std::string & msg) {
    const bool check_gpu  = params.n_gpu_layers != 0 && clover_has_gpu();
    const bool check_host = plan.n_parallel > 1;
    if (params.fit_margin_mib < 0 || !(check_gpu || check_host)) {
        return true;
    }
    std::vector<clover_device_memory> devs;
    if (!clover_plan_memory(path, plan.mparams, plan.cparams, devs, msg)) {
        return false;
    }
    if (check_gpu) {
        std::vector<char> buf(4096);  // one line per device
        if (clover_check_fit(devs.data(), (int32_t) devs.size(), params.fit_margin_mib, buf.data(), buf.size()) != 0) {
            msg = buf.data();
            return false;
        }
    }
    return !check_host || clover_check_host_fit(devs, params.fit_margin_mib, plan.n_parallel, msg);
}

// the model and context of a plan; each failure says why in msg, and what was made so far is freed
static clover_engine_ptr clover_engine_make(const char * path, clover_load_plan & plan, std::string & msg) {
    llama_model_ptr model(llama_model_load_from_file(path, plan.mparams));
    if (!model) {
        msg = clover_format("llama.cpp could not load '%s'", path);
        return nullptr;
    }
    if (!plan.bd_path.empty()) {
        std::vector<char> buf(1024);
        if (!llama_clover_attach_block_diffusion(model.get(), plan.bd_path.c_str(), buf.data(), buf.size())) {
            msg = buf.data();
            return nullptr;
        }
    }
    const llama_vocab * vocab = llama_model_get_vocab(model.get());
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    if (plan.info.mask_token_id >= 0 && plan.info.mask_token_id >= n_vocab) {
        msg = clover_format("mask token id %d is outside the vocabulary (%d)", plan.info.mask_token_id, n_vocab);
        return nullptr;
    }
    llama_context_ptr ctx(llama_init_from_model(model.get(), plan.cparams));
    if (!ctx) {
        msg = "llama.cpp could not create the context";
        return nullptr;
    }
    if ((int32_t) llama_n_rs_seq(ctx.get()) < plan.max_block - 1) {
        msg = clover_format("the context has n_rs_seq = %u, rollback of B-1 = %d positions needs more",
                            llama_n_rs_seq(ctx.get()), plan.max_block - 1);
        return nullptr;
    }
    clover_engine_ptr eng(new (std::nothrow) clover_engine());
    if (!eng) {
        msg = "out of memory";
        return nullptr;
    }
    eng->info             = plan.info;
    eng->info.n_vocab     = n_vocab;
    eng->info.n_ctx_train = llama_model_n_ctx_train(model.get());
    eng->info.has_block_diffusion = llama_clover_has_block_diffusion(model.get()) ? 1 : 0;
    eng->coreset_top_p    = eng->info.coreset_top_p;
    if (!eng->info.has_block_diffusion) {
        eng->block_unavailable = "clover: this GGUF has no block-diffusion tensors (a trunk-only file, e.g. from llama.cpp's "
                                 "converter); diffusion and spec need them: make a sidecar with clover-convert MODEL_DIR --bd-only NAME.bd.gguf and load it with --bd NAME.bd.gguf";
    } else if (eng->info.mask_token_id < 0) {
        eng->block_unavailable = "clover: this GGUF has no mask token (no tokenizer.ggml.mask_token_id, and not exactly one "
                                 "control token named like 'mask'); diffusion and spec need one: set it with clover-convert --mask-token";
    }
    eng->can_block = eng->block_unavailable.empty();
    eng->vocab            = vocab;
    eng->mem              = llama_get_memory(ctx.get());
    eng->model            = model.release();  // freed by clover_engine_free from here on
    eng->ctx              = ctx.release();
    return eng;
}

float clover_info_threshold(const struct clover_model_info * info, int32_t block_size) {
    for (int32_t i = 0; i < info->n_calibrated; ++i) {
        if (info->calibrated_block_sizes[i] == block_size) {
            return info->calibrated_thresholds[i];
        }
    }
    return info->threshold;
}

struct clover_engine * clover_engine_load(const char * path, struct clover_engine_params params,
                                          char * err, size_t err_size) {
    clover_load_plan plan;
    std::string msg;
    clover_engine_ptr eng;
    if (clover_make_load_plan(path, params, plan, msg) && clover_check_plan_fits(path, params, plan, msg)) {
        eng = clover_engine_make(path, plan, msg);
    }
    if (!eng) {
        clover_set_err(err, err_size, msg);
        return nullptr;
    }
    eng->n_ctx          = plan.n_ctx;
    eng->n_batch        = plan.n_batch;
    eng->max_block_size = plan.max_block;
    eng->n_vocab        = eng->info.n_vocab;
    eng->batch_cap      = plan.n_batch;
    eng->batch          = llama_batch_init(plan.n_batch, 0, 1);
    for (llama_token t = 0; t < eng->n_vocab; ++t) {
        if (llama_vocab_is_eog(eng->vocab, t)) {
            eng->eog_ids.push_back(t);
        }
    }
    if (!clover_make_slots(eng.get(), plan.n_parallel, (int32_t) plan.cparams.n_ubatch, msg)) {
        clover_set_err(err, err_size, msg);
        return nullptr;
    }
    clover_set_err(err, err_size, "");
    return eng.release();
}

int32_t clover_engine_describe_offload(const char * path, struct clover_engine_params params,
                                       char * out, size_t out_size, char * err, size_t err_size) {
    clover_load_plan plan;
    std::string msg;
    if (!clover_make_load_plan(path, params, plan, msg)) {
        clover_set_err(err, err_size, msg);
        return -1;
    }
    const llama_model_params & mp = plan.mparams;
    std::string text = clover_format("n_gpu_layers=%d\nsplit_mode=%d\nmain_gpu=%d\n", mp.n_gpu_layers,
                                     (int) mp.split_mode, mp.main_gpu);
    text += "tensor_split=";
    for (size_t i = 0; mp.tensor_split && i < llama_max_devices(); ++i) {
        text += clover_format("%s%g", i ? "," : "", mp.tensor_split[i]);
    }
    text += "\n";
    for (const auto * o = mp.tensor_buft_overrides; o && o->pattern; ++o) {
        text += std::string("override=") + o->pattern + "=" + ggml_backend_buft_name(o->buft) + "\n";
    }
    if (text.size() + 1 > out_size) {
        clover_set_err(err, err_size, clover_format("the description needs %zu bytes", text.size() + 1));
        return -1;
    }
    clover_set_err(out, out_size, text);
    clover_set_err(err, err_size, "");
    return 0;
}

int32_t clover_engine_plan_memory(const char * path, struct clover_engine_params params,
                                  struct clover_device_memory * out, int32_t n_out, char * err, size_t err_size) {
    clover_load_plan plan;
    std::string msg;
    std::vector<clover_device_memory> devs;
    if (!clover_make_load_plan(path, params, plan, msg) || !clover_plan_memory(path, plan.mparams, plan.cparams, devs, msg)) {
        clover_set_err(err, err_size, msg);
        return -1;
    }
    const int32_t n = std::min((int32_t) devs.size(), std::max(n_out, 0));
    for (int32_t i = 0; out && i < n; ++i) {
        out[i] = devs[i];
    }
    clover_set_err(err, err_size, "");
    return n;
}

void clover_engine_free(struct clover_engine * engine) {
    if (!engine) {
        return;
    }
    for (auto & slot : engine->slots) {
        llama_batch_free(slot->batch);
    }
    engine->slots.clear();
    llama_batch_free(engine->batch);
    if (engine->ctx) {
        llama_free(engine->ctx);
    }
    if (engine->model) {
        llama_model_free(engine->model);
    }
    delete engine;
}

const struct clover_model_info * clover_engine_info(const struct clover_engine * engine) {
    return engine ? &engine->info : nullptr;
}

struct clover_engine * clover_engine_slot(struct clover_engine * engine, int32_t i) {
    if (!engine || i < 0 || i > (int32_t) engine->slots.size()) {
        return nullptr;
    }
    return i == 0 ? engine : engine->slots[i - 1].get();
}

int32_t clover_engine_n_parallel(const struct clover_engine * engine) {
    return engine ? 1 + (int32_t) engine->slots.size() : 0;
}

void clover_engine_pass_stats(const struct clover_engine * engine, int64_t * n_passes, int64_t * n_rounds) {
    const bool shared = engine && engine->shared;
    if (shared) {
        *n_passes = engine->shared->n_passes.load();
        *n_rounds = engine->shared->n_rounds.load();
    } else {
        *n_passes = 0;
        *n_rounds = 0;
    }
}

struct llama_model * clover_engine_model(struct clover_engine * engine) {
    return engine ? engine->model : nullptr;
}

struct llama_context * clover_engine_context(struct clover_engine * engine) {
    return engine ? engine->ctx : nullptr;
}

void clover_engine_reset(struct clover_engine * engine) {
    if (!engine) {
        return;
    }
    clover_slot_guard guard(engine, false);
    llama_set_causal_attn(engine->ctx, true);
    if (engine->shared) {  // this slot's sequences only
        llama_memory_seq_rm(engine->mem, engine->seq_history, -1, -1);
        llama_memory_seq_rm(engine->mem, engine->seq_scratch, -1, -1);
    } else {
        llama_memory_clear(engine->mem, true);
    }
    engine->n_past   = 0;
    engine->has_pending = false;
    engine->pending     = 0;
    engine->history.clear();
    clover_cache_forget_all(engine);  // the checkpoints describe positions that are gone
}

int32_t clover_engine_n_past(const struct clover_engine * engine) {
    return engine ? engine->n_past : 0;
}

int32_t clover_engine_n_ctx(const struct clover_engine * engine) {
    return engine ? engine->n_ctx : 0;
}

int32_t clover_engine_max_block_size(const struct clover_engine * engine) {
    return engine ? engine->max_block_size : 0;
}

int32_t clover_engine_n_threads(const struct clover_engine * engine) {
    return engine ? (int32_t) llama_n_threads(engine->ctx) : 0;
}

const char * clover_engine_last_error(const struct clover_engine * engine) {
    return engine ? engine->last_error.c_str() : "engine is NULL";
}

int32_t clover_generate(struct clover_engine * engine, const llama_token * prompt, int32_t n_prompt,
                        const struct clover_gen_params * params,
                        clover_tokens_cb on_tokens, clover_step_cb on_step, void * user_data,
                        struct clover_stats * stats) {
    if (!engine) {
        return -1;
    }
    clover_engine * eng = engine;
    clover_slot_guard guard(eng, true);
    eng->last_error.clear();
    clover_stats local_stats;
    if (!stats) {
        stats = &local_stats;
    }
    *stats = {};
    stats->n_prompt_tokens = n_prompt;
    const clover_gen_params defaults = clover_gen_default_params();
    if (!params) {
        params = &defaults;
    }

    clover_run run;
    std::string err;
    float coreset_top_p = eng->info.coreset_top_p;
    if (!clover_resolve_params(eng, params, run.block_size, run.threshold, err) ||
        !clover_check_params(eng, params, prompt, n_prompt, err) ||
        !clover_check_block_params(eng, params, coreset_top_p, err) || !clover_init_sampler(eng, params, run.smp, err)) {
        eng->last_error = err;  // nothing was touched
        return -1;
    }
    eng->coreset_top_p = coreset_top_p;
    run.eng       = eng;
    run.params    = params;
    run.budget    = params->max_tokens;
    run.on_tokens = on_tokens;
    run.on_step   = on_step;
    run.user_data = user_data;
    run.stats     = stats;

    if (eng->rewound) {  // a cancelled generation left a truncated history that only reuse_prefix continues
        clover_engine_reset(eng);
    }
    if (!clover_prefill(eng, prompt, n_prompt, stats)) {
        return -1;
    }
    const bool ok = clover_dispatch(run);
    stats->n_generated = run.n_out;
    if (run.cancelled) {
        // back to where the answer started (its prompt stays reusable), or a fresh history
        if (!clover_cache_rewind(eng)) {
            clover_engine_reset(eng);
        }
        stats->stop_reason = CLOVER_STOP_CANCELLED;
        return run.n_out;
    }
    if (!ok) {
        eng->last_error = (eng->last_error.empty() ? std::string("generation failed") : eng->last_error) + "; the engine was reset";
        clover_engine_reset(eng);
        return -1;
    }
    return run.n_out;
}

int32_t clover_engine_measure_costs(struct clover_engine * engine, struct clover_pass_costs * out) {
    if (!engine) {
        return -1;
    }
    clover_slot_guard guard(engine, false);
    clover_pass_costs costs;
    if (!clover_measure_costs(engine, costs)) {
        return -1;
    }
    engine->costs     = costs;
    engine->has_costs = true;
    if (out) {
        *out = costs;
    }
    return 0;
}

int32_t clover_engine_set_costs(struct clover_engine * engine, const struct clover_pass_costs * costs) {
    if (!engine || !costs) {
        return -1;
    }
    const float v[] = { costs->ar_ms, costs->causal_fixed_ms, costs->causal_row_ms, costs->rebuild_ms,
                        costs->block_fixed_ms, costs->block_row_ms };
    for (float x : v) {
        if (!std::isfinite(x) || x < 0.0f) {
            engine->last_error = "pass costs must be finite and >= 0";
            return -1;
        }
    }
    if (!(costs->ar_ms > 0.0f) || !(costs->causal_fixed_ms + costs->causal_row_ms > 0.0f)) {
        engine->last_error = "the ar step and a 1-row causal pass must cost more than 0 ms";
        return -1;
    }
    engine->costs     = *costs;
    engine->has_costs = true;
    return 0;
}

int32_t clover_engine_get_costs(const struct clover_engine * engine, struct clover_pass_costs * out) {
    if (!engine || !out || !engine->has_costs) {
        return -1;
    }
    *out = engine->costs;
    return 0;
}

} // extern "C"
