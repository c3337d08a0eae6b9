// Slots: several generations on one model and one llama_context (llama-server's -np), with their passes batched.
//
// Slot i owns sequences 2i (history) and 2i + 1 (scratch). Every slot runs the engine's ordinary code on its own
// thread, under the shared lock. Where a slot would call llama_decode it queues the pass instead and waits; when
// every slot inside clover_slot_generate has queued one, the engine's decode thread (clover_shared) runs the oldest
// pass and the later ones of the same kind as one llama_decode: block windows of the same width, or causal passes
// of any lengths (a long prompt's prefill chunk and the other slots' steps, n_prefill_chunk; a prefilling slot
// gets at most 40% of the time while others wait, clover_chunks_wait). The unified KV cache keeps the sequences
// apart (a block window sees its own history and window only), and llama.cpp's equal split puts same-size
// sequences in one ubatch and splits unequal ones. So a slot's logits are those of its own pass run alone, up to
// the floating-point order of a larger batch. Auto mode's drafts meet the same way: the slots waiting on a draft get
// theirs from one call of llama.cpp's speculative framework, which runs draft-clover's windows as one block pass, as
// llama-server's slots do.

#include "clover-auto.h"
#include "clover-decode.h"
#include "clover-llama.h"
#include "clover-parallel.h"
#include "clover-slot.h"

#include <algorithm>
#include <cstring>
#include <functional>

namespace {
void clover_decode_loop(clover_shared & sh);
}  // namespace

clover_slot_guard::clover_slot_guard(clover_slot * slot, bool generating)
    : slot_(slot), generating_(generating && slot && slot->shared && !slot->lock) {
    if (!slot || !slot->shared || slot->lock) {  // one slot, or a nested call of the thread that holds the lock
        return;
    }
    slot->shared->n_entering++;
    lock_ = std::unique_lock<std::mutex>(slot->shared->mu);
    slot->shared->n_entering--;
    slot->lock = &lock_;
    if (generating_) {
        slot->shared->n_generating++;
    }
}

clover_slot_guard::~clover_slot_guard() {
    if (!lock_.owns_lock()) {
        return;
    }
    if (generating_) {
        slot_->shared->n_generating--;
    }
    slot_->shared->cv.notify_all();  // a round may have waited for this slot, or for a slot to take the lock
    slot_->lock = nullptr;
}

void clover_share_context(clover_engine & engine, int32_t n_ubatch) {
    auto shared = std::make_shared<clover_shared>();
    shared->batch    = llama_batch_init(std::max(engine.slots[0]->batch_cap, n_ubatch), 0, 1);
    shared->n_ubatch = n_ubatch;
    shared->ctx      = engine.ctx.get();
    for (auto & slot : engine.slots) {
        slot->shared = shared;
    }
    shared->decoder = std::thread(clover_decode_loop, std::ref(*shared));
}

// the slots go before the engine's context (clover_engine), and with the last one the decode thread
clover_shared::~clover_shared() {
    {
        std::lock_guard<std::mutex> lock(mu);
        stopping = true;
    }
    cv.notify_all();
    if (decoder.joinable()) {
        decoder.join();
    }
    llama_batch_free(batch);
}

int32_t clover_block_decode_seqs(llama_context * ctx, const llama_batch & batch, const llama_seq_id * history,
                                 const llama_seq_id * scratch, int32_t n_slots) {
    if (!llama_clover_has_block_diffusion(llama_get_model(ctx))) {
        return -3;  // a trunk-only file: no block pass (its graph needs the bd_* tensors)
    }
    const bool causal = llama_clover_block_begin(ctx, history, scratch, n_slots);
    const int32_t rc = llama_decode(ctx, batch);
    llama_clover_block_end(ctx, scratch, n_slots, causal);
    return rc;
}

namespace {

// a causal pass that may be rolled back inside itself: a verification of more than one row
bool clover_may_roll_back(const clover_pass_req & r) {
    return !r.block && !r.prefill && r.slot->batch.n_tokens > 1;
}

bool clover_same_kind(const clover_pass_req & a, const clover_pass_req & b) {
    // Block windows of one round have one width (a window is one ubatch; each has its own sequence's coreset
    // top_p). Causal passes of other lengths go together (a prefill chunk and other slots' steps: llama.cpp splits
    // them), except a verification: the recurrent memory rolls a sequence back only within the ubatch that wrote
    // its rows, and llama.cpp's equal split of sequences of unequal lengths spreads the longer one over several
    // ubatches. A verification goes only with passes of its own length (tests/engine/test_parallel_slots.py: four
    // slots in auto diverged from their solo runs about once in twelve before).
    if (a.block != b.block) {
        return false;
    }
    if (a.block || clover_may_roll_back(a) || clover_may_roll_back(b)) {
        return a.slot->batch.n_tokens == b.slot->batch.n_tokens;
    }
    return true;
}

// Whether prefill chunks sit this round out: a prefilling slot gets at most clover_prefill_share of the decode
// time while other slots have passes waiting, so that their mean time per token stays within about
// 1 / (1 - share) = 1.7x its idle value (the chunk's rounds carry their passes too). The rest of a long prompt's
// TTFT cost is the same ratio the other way, about 2.5x while another slot decodes all along.
constexpr double clover_prefill_share = 0.4;

bool clover_chunks_wait(const clover_shared & sh) {
    const bool others = std::any_of(sh.pending.begin(), sh.pending.end(),
                                    [](const clover_pass_req * r) { return !r->prefill; });
    return others && sh.t_prefill_ms * (1.0 - clover_prefill_share) > sh.t_others_ms * clover_prefill_share;
}

// the oldest pending pass, and the later ones it can share a ubatch with (each slot's tokens whole in it)
std::vector<clover_pass_req *> clover_pick_group(const clover_shared & sh) {
    const bool chunks_wait = clover_chunks_wait(sh);
    std::vector<clover_pass_req *> group;
    int32_t total = 0;
    for (clover_pass_req * r : sh.pending) {
        if (chunks_wait && r->prefill) {
            continue;
        }
        const int32_t n = r->slot->batch.n_tokens;
        if (group.empty() || (clover_same_kind(*group[0], *r) && total + n <= sh.n_ubatch)) {
            group.push_back(r);
            total += n;
        }
    }
    return group;
}

// the logits rows each slot asked for, copied out of the context before the next round overwrites them
bool clover_keep_rows(llama_context * ctx, clover_pass_req & r, int32_t offset) {
    clover_slot * slot = r.slot;
    const llama_batch & b = slot->batch;
    slot->row_of.assign(b.n_tokens, -1);
    int32_t n_rows = 0;
    for (int32_t j = 0; j < b.n_tokens; ++j) {
        n_rows += b.logits[j] ? 1 : 0;
    }
    slot->rows.resize((size_t) n_rows * slot->n_vocab);
    int32_t k = 0;
    for (int32_t j = 0; j < b.n_tokens; ++j) {
        if (!b.logits[j]) {
            continue;
        }
        const float * src = llama_get_logits_ith(ctx, offset + j);
        if (!src) {
            return false;
        }
        std::memcpy(slot->rows.data() + (size_t) k * slot->n_vocab, src, sizeof(float) * slot->n_vocab);
        slot->row_of[j] = k++;
    }
    return true;
}

// the fair-share clocks (clover_chunks_wait): a round's time counts for the prefill when it ran a chunk, for
// the others when a chunk waited; both restart when no prefill is in sight
void clover_share_time(clover_shared & sh, const std::vector<clover_pass_req *> & group, double ms) {
    const auto is_chunk = [](const clover_pass_req * r) { return r->prefill; };
    if (std::any_of(group.begin(), group.end(), is_chunk)) {
        sh.t_prefill_ms += ms;
    } else if (std::any_of(sh.pending.begin(), sh.pending.end(), is_chunk)) {
        sh.t_others_ms += ms;
    } else {
        sh.t_prefill_ms = sh.t_others_ms = 0.0;
    }
}

void clover_run_round(clover_shared & sh, const std::vector<clover_pass_req *> & group) {
    llama_context * ctx = sh.ctx;
    for (clover_pass_req * r : group) {
        sh.pending.erase(std::find(sh.pending.begin(), sh.pending.end(), r));
    }
    const double t0 = clover_now_ms();
    const bool block = group[0]->block;
    const llama_batch * batch = &group[0]->slot->batch;
    std::vector<int32_t> offsets(group.size(), 0);
    if (group.size() > 1) {
        llama_batch & all = sh.batch;
        clover_batch_clear(all);
        for (size_t g = 0; g < group.size(); ++g) {
            const llama_batch & b = group[g]->slot->batch;
            offsets[g] = all.n_tokens;
            for (int32_t j = 0; j < b.n_tokens; ++j) {
                clover_batch_add(all, b.token[j], b.pos[j], b.seq_id[j][0], b.logits[j]);
            }
        }
        batch = &all;
    }
    int32_t rc = 0;
    if (block) {
        std::vector<llama_seq_id> history, scratch;
        for (clover_pass_req * r : group) {
            history.push_back(r->slot->seq_history);
            scratch.push_back(r->slot->seq_scratch);
        }
        rc = clover_block_decode_seqs(ctx, *batch, history.data(), scratch.data(), (int32_t) group.size());
    } else {
        rc = llama_decode(ctx, *batch);
    }
    clover_share_time(sh, group, clover_now_ms() - t0);
    for (size_t g = 0; g < group.size(); ++g) {
        group[g]->rc   = rc == 0 && !clover_keep_rows(ctx, *group[g], offsets[g]) ? -100 : rc;
        group[g]->done = true;
    }
    sh.n_passes += (int64_t) group.size();
    sh.n_rounds += 1;
    if (block) {
        sh.n_block_passes += (int64_t) group.size();
        sh.n_block_rounds += 1;
    }
}

// The drafts of every waiting slot (auto mode): each slot's parameters, then one call of the engine's drafter (its
// slots share it), which drafts every sequence asked for and batches draft-clover's windows into one block pass.
void clover_run_drafts(clover_shared & sh) {
    const std::vector<clover_draft_req *> reqs(sh.drafts.begin(), sh.drafts.end());
    sh.drafts.clear();
    common_speculative * spec = reqs.front()->slot->drafter->spec.get();
    for (clover_draft_req * r : reqs) {
        clover_draft_ask(spec, r->slot, r->n_max, *r->result);
    }
    const double t0 = clover_now_ms();
    common_speculative_draft(spec);
    clover_share_time(sh, {}, clover_now_ms() - t0);
    int64_t n_windows = 0;
    for (clover_draft_req * r : reqs) {
        r->block = clover_draft_settle(spec, r->slot, *r->result);
        r->done  = true;
        n_windows += r->block ? 1 : 0;
    }
    if (n_windows > 0) {
        sh.n_passes       += n_windows;
        sh.n_rounds       += 1;
        sh.n_block_passes += n_windows;
        sh.n_block_rounds += 1;
    }
}

// The decode thread: a slot's call outside the rounds, else a round once every slot inside clover_slot_generate
// has queued a pass or a draft (the drafts first). A round also lets a slot blocked on the lock take it first: a
// generation that starts then joins the rounds, and a short call (reuse_prefix, reset) runs between two rounds. A
// slot that is not generating is not waited for once it holds the lock: its pass runs in the next round.
void clover_decode_loop(clover_shared & sh) {
    std::unique_lock<std::mutex> lock(sh.mu);
    while (true) {
        if (!sh.calls.empty()) {
            clover_call_req * call = sh.calls.front();
            sh.calls.pop_front();
            call->rc   = (*call->fn)();
            call->done = true;
            sh.cv.notify_all();
            continue;
        }
        const int32_t n_waited = sh.n_generating + sh.n_entering.load();
        const int32_t n_queued = (int32_t) (sh.pending.size() + sh.drafts.size());
        if (n_queued > 0 && n_queued >= std::max<int32_t>(n_waited, 1)) {
            if (!sh.drafts.empty()) {
                clover_run_drafts(sh);
            } else {
                clover_run_round(sh, clover_pick_group(sh));
            }
            sh.cv.notify_all();
            continue;
        }
        if (sh.stopping) {
            return;
        }
        sh.cv.wait(lock);
    }
}

}  // namespace

namespace {

// hand req to the decode thread through queue and wait, the slot's lock released, until the thread has run it
template <typename Req>
void clover_queue_and_wait(clover_slot * slot, std::deque<Req *> & queue, Req & req) {
    queue.push_back(&req);
    slot->shared->cv.notify_all();
    while (!req.done) {
        slot->shared->cv.wait(*slot->lock);
    }
}

}  // namespace

int32_t clover_parallel_pass(clover_slot * slot, bool block) {
    clover_pass_req req;
    req.slot    = slot;
    req.block   = block;
    req.prefill = slot->prefilling;
    clover_queue_and_wait(slot, slot->shared->pending, req);
    return req.rc;
}

bool clover_parallel_draft(clover_slot * slot, int32_t n_max, llama_tokens & draft) {
    clover_draft_req req;
    req.slot   = slot;
    req.n_max  = n_max;
    req.result = &draft;
    clover_queue_and_wait(slot, slot->shared->drafts, req);
    return req.block;
}

int32_t clover_shared_call(clover_slot * slot, const std::function<int32_t()> & fn) {
    if (!slot->shared || !slot->lock) {
        return fn();
    }
    clover_call_req req;
    req.fn = &fn;
    clover_queue_and_wait(slot, slot->shared->calls, req);
    return req.rc;
}
