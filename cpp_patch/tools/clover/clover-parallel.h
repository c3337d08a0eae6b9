// Slots sharing one context (clover-parallel.cpp): their passes batched in rounds on one decode thread, and the
// lock a slot holds while it runs engine code. Not part of the C API.

#pragma once

#include "clover.h"
#include "clover-slot.h"
#include "llama.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

// A pass one slot waits to run (clover-parallel.cpp): the slot's batch, causal or a block window
struct clover_pass_req {
    clover_slot * slot    = nullptr;
    bool          block   = false;
    bool          prefill = false;  // a chunk of a prompt's prefill (clover_prefill)
    bool          done    = false;
    int32_t       rc      = 0;
};

// A call one slot hands the decode thread outside the rounds (clover_shared_call)
struct clover_call_req {
    const std::function<int32_t()> * fn   = nullptr;
    bool                             done = false;
    int32_t                          rc   = 0;
};

// A draft one slot waits for (clover_parallel_draft): the decode thread asks llama.cpp's speculative framework for the
// drafts of every waiting slot in one call, so that draft-clover's windows share a block pass
struct clover_draft_req {
    clover_slot  * slot   = nullptr;  // its drafter is the engine's (slot->drafter)
    int32_t        n_max  = 0;
    llama_tokens * result = nullptr;
    bool           block  = false;  // the draft came from a block pass
    bool           done   = false;
};

// What the slots of one context share when n_parallel > 1: the lock that serializes their use of the context,
// the queue where their passes meet, and the thread that runs every pass on the context. A slot holds `mu` while
// it runs engine code; it waits on `cv` (and so releases `mu`) only for its pass. A round starts when every slot
// inside clover_slot_generate has queued a pass or a draft and no slot is waiting to take the lock (a generation
// never yields it otherwise).
//
// One thread decodes for all slots, as llama-server's one loop does. ggml's CPU backend (OpenMP) keeps a pool
// of workers per calling thread, and libgomp counts the workers of every pool: with a pool per slot thread they
// outnumber the cores, and libgomp then sleeps at each barrier instead of spinning. A one-token step of `mid`
// Q8_0 took 29 ms instead of 17 ms that way (2-core Xeon, two slot threads).
struct clover_shared {
    std::mutex                    mu;
    std::condition_variable       cv;
    std::atomic<int32_t>          n_entering{0};  // slots blocked on `mu` at the start of a C API call
    int32_t                       n_generating = 0;
    std::deque<clover_pass_req *> pending;
    std::deque<clover_draft_req *> drafts;
    llama_batch                   batch    = {};  // the combined batch of a round
    llama_context               * ctx      = nullptr;
    int32_t                       n_ubatch = 0;
    // Fair share while a slot prefills and others generate: the decode time of rounds that ran a prefill chunk,
    // and of rounds that ran other slots' passes while a chunk waited. A chunk waits while it is ahead.
    double                        t_prefill_ms = 0.0;
    double                        t_others_ms  = 0.0;
    std::atomic<int64_t>          n_passes{0};  // read without the lock (/health must not wait for a prefill)
    std::atomic<int64_t>          n_rounds{0};
    std::atomic<int64_t>          n_block_passes{0};  // the block passes among them (draft-clover's windows too),
                                                      // and the rounds that ran them (a framework call for drafts)
    std::atomic<int64_t>          n_block_rounds{0};
    // the decode thread (clover_decode_loop), and the calls slots hand it outside the rounds (clover_shared_call)
    std::thread                       decoder;
    bool                              stopping = false;
    std::deque<clover_call_req *>     calls;

    ~clover_shared();
};

// slots (clover-parallel.cpp)
// with n_parallel > 1: the lock and the queue the engine's slots share, and the batch of their rounds
void clover_share_context(clover_engine & engine, int32_t n_ubatch);
// with a shared context: queue the slot's batch (slot->batch; a block window when `block`) and return after a round
// ran it; its logits are then read with clover_get_row. The caller holds the slot's lock (clover_slot_guard).
int32_t clover_parallel_pass(clover_slot * slot, bool block);
// with a shared context: queue a draft of the slot's sequence by the engine's drafter (auto mode), at most n_max
// tokens into `draft`, and return after a round of drafts ran it; whether it came from a block pass. The caller holds
// the slot's lock.
bool clover_parallel_draft(clover_slot * slot, int32_t n_max, llama_tokens & draft);
// run `fn` (a llama_decode outside the rounds) on the decode thread when the slot's context is shared, else here
int32_t clover_shared_call(clover_slot * slot, const std::function<int32_t()> & fn);
// run the block windows of n_slots slots (the batch on their scratch sequences) between llama_clover_block_begin and
// _end (src/llama-clover.h); -3 for a file without block passes
int32_t clover_block_decode_seqs(llama_context * ctx, const llama_batch & batch, const llama_seq_id * history,
                                 const llama_seq_id * scratch, int32_t n_slots);

// Holds a slot's share of the engine for one C API call (no-op with one slot); `generating` marks the slot as one
// whose passes a round waits for.
class clover_slot_guard {
  public:
    clover_slot_guard(clover_slot * slot, bool generating);
    ~clover_slot_guard();
    clover_slot_guard(const clover_slot_guard &) = delete;
    clover_slot_guard & operator=(const clover_slot_guard &) = delete;

  private:
    clover_slot *                slot_;
    bool                         generating_;
    std::unique_lock<std::mutex> lock_;
};

// Releases a slot's share of the engine while a callback runs (other slots go on with their bookkeeping; a round
// still waits for this slot's next pass); no-op with one slot.
class clover_callback_scope {
  public:
    explicit clover_callback_scope(clover_slot * slot) : lock_(slot->lock) {
        if (lock_) {
            lock_->unlock();
        }
    }
    ~clover_callback_scope() {
        if (lock_) {
            lock_->lock();
        }
    }
    clover_callback_scope(const clover_callback_scope &) = delete;
    clover_callback_scope & operator=(const clover_callback_scope &) = delete;

  private:
    std::unique_lock<std::mutex> * lock_;
};
