// Distributions and the sampler of the Clover engine (shared/clover-spec.md section 4, "Distributions and
// confidence"): the distribution stage (logit_bias, penalties, grammar), the acceptance of a draft token in a
// verification (spec 4.2), and logprobs. Q (temperature, top-k, top-p) and its draws are llama.cpp's sampler chain
// (common_sampler), the one llama-server samples with; a block target's token and confidence are common's
// (common_sampler_sample_target, through common_block_diffusion_step).

#include "clover-gen-params.h"
#include "clover-log.h"
#include "clover-run.h"
#include "clover-sampling.h"
#include "clover-slot.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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

// one target's logits as the chain's candidates, in vocabulary order (what the logit-bias and penalties samplers look
// tokens up by), the mask token and the banned ids at -inf; in the sampler's scratch array
static llama_token_data_array clover_candidates(clover_run & run, const float * logits) {
    clover_sampler & smp = run.smp;
    const int32_t n_vocab = run.slot->n_vocab;
    smp.cur.resize(n_vocab);
    for (llama_token id = 0; id < n_vocab; ++id) {
        smp.cur[id] = { id, smp.excluded[id] ? -std::numeric_limits<float>::infinity() : logits[id], 0.0f };
    }
    return { smp.cur.data(), smp.cur.size(), -1, false };
}

//
// the distribution stage (spec 4): logit_bias, penalties, grammar
//

// the grammar's full mask: what it forbids after the response so far goes to -inf (llama.cpp's grammar, which also
// keeps the text well-formed UTF-8 and never ends it inside a character). Only the candidates that can still win are
// checked: the excluded ids and -inf logits stay out of the grammar's work.
static void clover_grammar_mask(clover_run & run, llama_sampler * grammar, float * logits) {
    std::vector<llama_token_data> & cur = run.smp.cur;
    cur.clear();
    for (int32_t i = 0; i < run.slot->n_vocab; ++i) {
        if (!run.smp.excluded[i] && logits[i] != -std::numeric_limits<float>::infinity()) {
            cur.push_back({ i, logits[i], 0.0f });
        }
    }
    llama_token_data_array arr = { cur.data(), cur.size(), -1, false };
    llama_sampler_apply(grammar, &arr);
    for (size_t k = 0; k < arr.size; ++k) {
        logits[arr.data[k].id] = arr.data[k].logit;
    }
}

void clover_dist_apply(clover_run & run, float * logits, bool full_grammar) {
    clover_dist & d = run.dist;
    if (d.staged()) {
        // the chain's logit bias and penalties (llama.cpp's rule, the penalties over this response's tokens only)
        llama_token_data_array arr = clover_candidates(run, logits);
        common_sampler_apply_stage(run.smp.chain.get(), &arr, d.window_penalties);
        for (size_t id = 0; id < arr.size; ++id) {
            logits[id] = arr.data[id].logit;
        }
    }
    llama_sampler * grammar = full_grammar ? run.grammar() : nullptr;
    if (grammar) {
        clover_grammar_mask(run, grammar, logits);
    }
}

// whether the grammar allows the token next (one candidate: cheap)
static bool clover_grammar_allows(llama_sampler * grammar, llama_token token, float logit) {
    llama_token_data one = { token, logit, 0.0f };
    llama_token_data_array arr = { &one, 1, -1, false };
    llama_sampler_apply(grammar, &arr);
    return one.logit != -std::numeric_limits<float>::infinity();
}

// The argmax the grammar allows: the plain argmax when allowed (one check), else the best after the full mask.
// -1 when nothing is left.
static llama_token clover_grammar_argmax(clover_run & run, llama_sampler * grammar, float * logits) {
    const int32_t n_vocab = run.slot->n_vocab;
    llama_token best = clover_argmax(run.smp, logits, n_vocab);
    if (!clover_grammar_allows(grammar, best, logits[best])) {
        clover_grammar_mask(run, grammar, logits);
        best = clover_argmax(run.smp, logits, n_vocab);
    }
    return logits[best] == -std::numeric_limits<float>::infinity() ? -1 : best;
}

clover_draft_grammar::clover_draft_grammar(const clover_run & run) {
    if (llama_sampler * grammar = run.grammar()) {
        state.reset(llama_sampler_clone(grammar));
    }
}

void clover_draft_grammar::known(clover_run & run, llama_token token) {
    if (state) {
        advance(run, token, !clover_grammar_allows(state.get(), token, 0.0f));
    }
}

llama_token clover_draft_grammar::draft(clover_run & run, float * logits) {
    if (!state) {
        return clover_argmax(run.smp, logits, run.slot->n_vocab);
    }
    const llama_token best = clover_grammar_argmax(run, state.get(), logits);
    if (best < 0) {
        state.reset();
        return clover_argmax(run.smp, logits, run.slot->n_vocab);
    }
    advance(run, best, false);  // clover_grammar_argmax has checked it
    return best;
}

void clover_draft_grammar::advance(clover_run & run, llama_token token, bool forbidden) {
    if (forbidden || run.is_stop(token)) {
        state.reset();  // the drafts after it cannot all be accepted anyway
        return;
    }
    llama_sampler_accept(state.get(), token);
}

// The chain stands in for another (a copy of it as it was) while this is in scope: clover_dist_apply and
// clover_dist_produce read and advance that one
class clover_chain_swap {
  public:
    clover_chain_swap(clover_run & run, common_sampler_ptr & other) : run(run), other(other) {
        std::swap(run.smp.chain, other);
    }
    ~clover_chain_swap() { std::swap(run.smp.chain, other); }
    clover_chain_swap(const clover_chain_swap &) = delete;
    clover_chain_swap & operator=(const clover_chain_swap &) = delete;

  private:
    clover_run         & run;
    common_sampler_ptr & other;
};

// log P of each verified token at its row (spec 4: after the stage and the grammar, at temperature 1), from a copy of
// the chain as it was before the rows, advanced over the tokens in order as the chain was
static void clover_rows_logprobs(clover_run & run, common_sampler_ptr & before, const std::vector<float *> & rows,
                                 const std::vector<llama_token> & tokens) {
    clover_chain_swap swap(run, before);
    for (size_t i = 0; i < tokens.size(); ++i) {
        clover_dist_apply(run, rows[i], true);
        run.dist.logprobs.push_back(clover_dist_logprob(run, rows[i], tokens[i]));
        clover_dist_produce(run, tokens[i]);
    }
}

bool clover_sample_rows(clover_run & run, const std::vector<float *> & rows, const llama_tokens & drafts,
                        std::vector<llama_token> & tokens) {
    common_sampler * chain = run.smp.chain.get();
    common_sampler_ptr before(run.dist.n_logprobs >= 0 ? common_sampler_clone(chain) : nullptr);
    const std::vector<const float *> in(rows.begin(), rows.end());
    try {
        // the chain's grammar_first says where its grammar goes (clover_init_chain)
        tokens = common_sampler_sample_and_accept_n(chain, run.slot->vocab, in, drafts);
    } catch (const std::invalid_argument &) {  // no candidate is left (common_sampler_sample)
        run.slot->last_error = run.grammar()
            ? "the grammar allows no token here (with the banned ids and logit_bias): the response cannot go on "
              "(a dead end of the grammar)"
            : "logit_bias and the banned ids leave no token to generate";
        return false;
    }
    if (before) {
        clover_rows_logprobs(run, before, rows, tokens);
    }
    return true;
}

void clover_dist_produce(clover_run & run, llama_token token) {
    common_sampler_accept(run.smp.chain.get(), token, true);  // the penalties count it, the grammar advances over it
}

clover_window_counts::clover_window_counts(clover_run & run, const std::vector<llama_token> & canvas)
    : run(run), counts(run.smp.chain.get(), canvas) {
    run.dist.window_penalties = counts.smpl;
}

clover_logprob clover_dist_logprob(const clover_run & run, const float * logits, llama_token token) {
    const int32_t n_vocab = run.slot->n_vocab;
    const float   ninf    = -std::numeric_limits<float>::infinity();
    auto allowed = [&](int32_t i) { return !run.smp.excluded[i] && logits[i] != ninf; };
    float max_v = ninf;
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (allowed(i)) {
            max_v = std::max(max_v, logits[i]);
        }
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (allowed(i)) {
            sum += std::exp((double) logits[i] - (double) max_v);
        }
    }
    const double log_z = (double) max_v + std::log(sum);
    clover_logprob out;
    out.token   = token;
    out.logprob = allowed(token) ? (float) ((double) logits[token] - log_z) : ninf;
    const int32_t k = std::max(0, run.dist.n_logprobs);
    if (k > 0) {
        std::vector<llama_token> ids;
        for (int32_t i = 0; i < n_vocab; ++i) {
            if (allowed(i)) {
                ids.push_back(i);
            }
        }
        const size_t n_top = std::min<size_t>((size_t) k, ids.size());
        std::partial_sort(ids.begin(), ids.begin() + n_top, ids.end(), [&](llama_token a, llama_token b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (size_t i = 0; i < n_top; ++i) {
            out.top_ids.push_back(ids[i]);
            out.top_logprobs.push_back((float) ((double) logits[ids[i]] - log_z));
        }
    }
    return out;
}

// llama.cpp's messages while a grammar is parsed (its parser reports through the log callback): the errors are
// kept for the error the caller gets, and only there (a caller's bad grammar is not the host's error to log); the
// rest go on to the host's callback
struct clover_log_capture {
    ggml_log_callback prev_cb   = nullptr;
    void            * prev_data = nullptr;
    std::string       errors;

    static void on_log(ggml_log_level level, const char * text, void * data) {
        auto * self = (clover_log_capture *) data;
        if (level == GGML_LOG_LEVEL_ERROR) {
            self->errors += text;
        } else if (self->prev_cb) {
            self->prev_cb(level, text, self->prev_data);
        }
    }
};

// The reason in llama.cpp's grammar errors: the parser's "parse: error parsing grammar: <why>\n\n<source>" gives
// <why> (its first line, cut at 200 bytes: it quotes the rest of the source), else the messages on one line
static std::string clover_grammar_reason(const std::string & errors) {
    static const std::string tag = "error parsing grammar: ";
    std::string why;
    const size_t at = errors.find(tag);
    if (at != std::string::npos) {
        why = errors.substr(at + tag.size());
        why = why.substr(0, why.find('\n'));
        if (why.size() > 200) {
            size_t n = 200;
            while (n > 0 && ((unsigned char) why[n] & 0xC0) == 0x80) {
                n--;  // not inside a UTF-8 character
            }
            why = why.substr(0, n) + "...";
        }
    } else {
        for (char c : errors) {
            why += c == '\n' ? ' ' : c;
        }
    }
    while (!why.empty() && why.back() == ' ') {
        why.pop_back();
    }
    return why;
}

// Runs parse (a grammar's parse: a llama_sampler_init_grammar, a common_sampler_init with a grammar) with the errors
// llama.cpp logs kept for the caller; false with a message when parse returned false or threw. The log callback is
// swapped for the call, under a lock, so that two parses never restore each other's callback.
template <typename F>
static bool clover_grammar_parse(F && parse, std::string & err) {
    static std::mutex mutex;
    clover_log_capture capture;
    bool ok = false;
    {
        std::lock_guard<std::mutex> lock(mutex);
        llama_log_get(&capture.prev_cb, &capture.prev_data);
        llama_log_set(clover_log_capture::on_log, &capture);
        try {
            ok = parse();
        } catch (const std::exception & e) {
            capture.errors += e.what();
        }
        llama_log_set(capture.prev_cb, capture.prev_data);
    }
    if (!ok) {
        const std::string why = clover_grammar_reason(capture.errors);
        err = "grammar: llama.cpp's GBNF parser rejected it" + (why.empty() ? std::string() : ": " + why);
    }
    return ok;
}

// a grammar's start symbol: root NULL or "" = "root"
static const char * clover_grammar_root(const char * root) {
    return root && root[0] ? root : "root";
}

// the grammar allows at least one token of the vocabulary (the excluded ids aside) at its start
static bool clover_grammar_opens(llama_sampler * smpl, int32_t n_vocab, const std::vector<uint8_t> & excluded) {
    std::vector<llama_token_data> cur;
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (excluded.empty() || !excluded[i]) {
            cur.push_back({ i, 0.0f, 0.0f });
        }
    }
    llama_token_data_array arr = { cur.data(), cur.size(), -1, false };
    llama_sampler_apply(smpl, &arr);
    for (const auto & c : cur) {
        if (c.logit != -std::numeric_limits<float>::infinity()) {
            return true;
        }
    }
    return false;
}

// a parsed grammar allows some token but the excluded ones at its start; false with a message otherwise
static bool clover_grammar_check_start(llama_sampler * smpl, int32_t n_vocab, const std::vector<uint8_t> & excluded,
                                       std::string & err) {
    try {
        if (!clover_grammar_opens(smpl, n_vocab, excluded)) {
            err = "grammar: it allows no token of the vocabulary at its start (the mask token and banned ids aside), "
                  "so nothing could be generated";
            return false;
        }
    } catch (const std::exception & e) {  // llama.cpp's grammar throws past its limits (too ambiguous)
        err = std::string("grammar: ") + e.what();
        return false;
    }
    return true;
}

int32_t clover_check_grammar(const llama_vocab * vocab, const char * grammar, const char * root,
                             const std::vector<uint8_t> & excluded, std::string & err) {
    llama_sampler_ptr smpl;
    const bool ok = clover_grammar_parse([&] {
        smpl.reset(llama_sampler_init_grammar(vocab, grammar ? grammar : "", clover_grammar_root(root)));
        return smpl != nullptr;
    }, err) && clover_grammar_check_start(smpl.get(), llama_vocab_n_tokens(vocab), excluded, err);
    return ok ? 0 : -1;
}

// flags[t] = 1 for each of the n ids; an id outside the vocabulary is an error naming `what`
static bool clover_mark_ids(const clover_slot * slot, const llama_token * ids, int32_t n, const char * what,
                            std::vector<uint8_t> & flags, std::string & err) {
    for (int32_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= slot->n_vocab) {
            err = clover_format("%s id %d is outside the vocabulary (%d)", what, ids[i], slot->n_vocab);
            return false;
        }
        flags[ids[i]] = 1;
    }
    return true;
}

// the call's penalties: its own, or the GGUF's where it gives NaN (spec 4), in the table's ranges
// (clover-gen-params.h; the GGUF's were checked at load)
static bool clover_init_penalties(const clover_slot * slot, const clover_gen_params * params, clover_dist & d,
                                  std::string & err) {
    const struct {
        clover_gen_param_id id;
        float               given;
        float               gguf;
        float &             out;
    } penalties[] = {
        { CLOVER_GEN_PARAM_REPEAT_PENALTY,    params->repeat_penalty,    slot->info.repeat_penalty,    d.repeat },
        { CLOVER_GEN_PARAM_PRESENCE_PENALTY,  params->presence_penalty,  slot->info.presence_penalty,  d.presence },
        { CLOVER_GEN_PARAM_FREQUENCY_PENALTY, params->frequency_penalty, slot->info.frequency_penalty, d.frequency },
    };
    for (const auto & p : penalties) {
        err = clover_gen_param_check(p.id, p.given);
        if (!err.empty()) {
            break;
        }
        p.out = clover_gen_param_is_unset(p.id, p.given) ? p.gguf : p.given;
    }
    return err.empty();
}

static bool clover_init_bias(const clover_slot * slot, const clover_gen_params * params, clover_dist & d,
                             std::string & err) {
    if (params->n_bias > 0 && (!params->bias_ids || !params->bias_values)) {
        err = "bias_ids or bias_values is NULL while n_bias > 0";
        return false;
    }
    for (int32_t i = 0; i < params->n_bias; ++i) {
        const llama_token id = params->bias_ids[i];
        const float       v  = params->bias_values[i];
        if (id < 0 || id >= slot->n_vocab) {
            err = clover_format("logit_bias id %d is outside the vocabulary (%d)", id, slot->n_vocab);
            return false;
        }
        if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) {
            err = clover_format("logit_bias of token %d must be finite or -inf, got %g", id, (double) v);
            return false;
        }
        d.bias.emplace_back(id, v);
    }
    return true;
}

bool clover_init_dist(const clover_slot * slot, const clover_gen_params * params, clover_dist & d, std::string & err) {
    if (!clover_init_bias(slot, params, d, err) || !clover_init_penalties(slot, params, d, err)) {
        return false;
    }
    d.n_logprobs = params->n_logprobs;
    return true;
}

// banned and stop ids, temperature
bool clover_init_sampler(const clover_slot * slot, const clover_gen_params * params, clover_sampler & smp,
                                std::string & err) {
    smp.excluded.assign(slot->n_vocab, 0);
    if (slot->info.mask_token_id >= 0) {
        smp.excluded[slot->info.mask_token_id] = 1;
    }
    if (!clover_mark_ids(slot, params->banned_ids, params->n_banned_ids, "banned", smp.excluded, err)) {
        return false;
    }
    if (std::find(smp.excluded.begin(), smp.excluded.end(), 0) == smp.excluded.end()) {
        err = "every token is banned";
        return false;
    }
    smp.stop.assign(slot->n_vocab, 0);
    const bool vocab_eog = params->n_stop_ids < 0;
    if (!clover_mark_ids(slot, vocab_eog ? slot->eog_ids.data() : params->stop_ids,
                         vocab_eog ? (int32_t) slot->eog_ids.size() : params->n_stop_ids, "stop", smp.stop, err)) {
        return false;
    }
    smp.temperature = params->temperature;
    return true;
}

// The call's grammar for its chain (common_sampler's grammar: the state common_sampler_accept advances), starting at
// once or after one of grammar_after_ids
static bool clover_chain_grammar(const clover_slot * slot, const clover_gen_params * params, common_params_sampling & sp,
                                 std::string & err) {
    if (params->n_grammar_after_ids > 0 && !params->grammar_after_ids) {
        err = "grammar_after_ids is NULL while n_grammar_after_ids > 0";
        return false;
    }
    if (!params->grammar || !params->grammar[0]) {
        return true;
    }
    std::vector<uint8_t> after(slot->n_vocab, 0);
    if (!clover_mark_ids(slot, params->grammar_after_ids, params->n_grammar_after_ids, "grammar_after", after, err)) {
        return false;
    }
    sp.grammar_after_tokens.assign(params->grammar_after_ids, params->grammar_after_ids + params->n_grammar_after_ids);
    sp.grammar      = common_grammar(COMMON_GRAMMAR_TYPE_USER, params->grammar);
    sp.grammar_root = clover_grammar_root(params->grammar_root);
    return true;
}

bool clover_init_chain(const clover_slot * slot, const clover_gen_params * params, clover_run & run,
                       std::string & err) {
    clover_sampler & smp = run.smp;
    clover_dist    & d   = run.dist;
    common_params_sampling sp;
    sp.temp            = params->temperature;
    sp.top_k           = params->top_k;
    sp.top_p           = params->top_p;
    sp.seed            = params->seed;  // LLAMA_DEFAULT_SEED (4294967295) draws a random seed, as in llama.cpp
    sp.penalty_last_n  = -1;            // the whole response: the chain counts only the tokens the run produces
    sp.penalty_repeat  = d.repeat;
    sp.penalty_freq    = d.frequency;
    sp.penalty_present = d.presence;
    if (smp.greedy()) {
        // the draw is argmax P whatever Q's truncations: top-k 1 picks it (the first of equal logits, as temperature 0
        // does) before the rest of the chain, which then runs over one candidate instead of the whole vocabulary; the
        // grammar checks that winner alone (the same argmax as masking first)
        sp.top_k    = 1;
        sp.samplers = { COMMON_SAMPLER_TYPE_TOP_K, COMMON_SAMPLER_TYPE_TEMPERATURE };
    } else {
        // spec 4.5's order, the grammar in P before the truncations (llama-server's grammar_first)
        sp.samplers      = { COMMON_SAMPLER_TYPE_TEMPERATURE, COMMON_SAMPLER_TYPE_TOP_K, COMMON_SAMPLER_TYPE_TOP_P };
        sp.grammar_first = true;
    }
    if (d.penalized()) {
        sp.samplers.insert(sp.samplers.begin(), COMMON_SAMPLER_TYPE_PENALTIES);
    }
    sp.no_perf = true;
    for (const auto & [id, bias] : d.bias) {
        sp.logit_bias.push_back({ id, bias });
    }
    for (int32_t i = 0; i < slot->n_vocab; ++i) {
        if (smp.excluded[i]) {  // the chain adds the vocabulary's mask token itself; the banned ids are the call's
            sp.logit_bias.push_back({ i, -std::numeric_limits<float>::infinity() });
        }
    }
    if (!clover_chain_grammar(slot, params, sp, err)) {
        return false;
    }
    std::string refused;  // a setting common_sampler refuses (std::invalid_argument), not the grammar
    auto make = [&] {
        try {
            smp.chain.reset(common_sampler_init(llama_get_model(slot->ctx), sp));
        } catch (const std::invalid_argument & e) {
            refused = e.what();
        }
        return true;
    };
    bool made = true;
    if (sp.grammar.empty()) {
        try {
            make();
        } catch (const std::exception & e) {
            refused = e.what();
        }
    } else {
        made = clover_grammar_parse(make, err);  // the chain parses the grammar: its errors are the grammar's
    }
    if (!refused.empty()) {
        err = "sampler: " + refused;
        return false;
    }
    // a grammar that starts at once must allow a token there
    return made && (sp.grammar.empty() || !sp.grammar_after_tokens.empty() ||
                    clover_grammar_check_start(run.grammar(), slot->n_vocab, smp.excluded, err));
}
