// Distributions and the sampler of the Clover engine (shared/clover-spec.md section 4, "Distributions and
// confidence"): P at temperature 1 with the mask token and banned ids excluded, Q after temperature, top-k and top-p,
// draws from Q, and the acceptance of a draft token in a verification (spec 4.2).

#include "clover-impl.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
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

// the token for one target (greedy: argmax P; else a draw from Q) and its confidence P(token)
clover_choice clover_choose(const clover_slot * slot, clover_sampler & smp, const float * logits) {
    const int32_t n_vocab = slot->n_vocab;
    const llama_token best = clover_argmax(smp, logits, n_vocab);
    const float max_v = logits[best];
    llama_token token = best;
    if (!smp.greedy()) {
        clover_sampling_dist(smp, logits, n_vocab);
        token = clover_draw(smp, smp.probs);
    }
    return { token, clover_prob(smp, logits, n_vocab, token, max_v) };
}

// The token of one verified target and whether its draft was accepted (draft < 0: none). Greedy: argmax P,
// accepted when it equals the draft; sampling: the draft with probability Q(d), else a draw from Q without d.
llama_token clover_accept(clover_run & run, const float * logits, llama_token draft, bool & accepted) {
    const int32_t n_vocab = run.slot->n_vocab;
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

// banned and stop ids, temperature, top-k/p and the seeded RNG
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
    smp.top_k       = params->top_k;
    smp.top_p       = params->top_p;
    smp.rng.seed(params->seed);
    return true;
}
