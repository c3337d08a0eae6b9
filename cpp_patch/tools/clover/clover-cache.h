// The prefix cache's checkpoints along a slot's history (clover-cache.cpp; the clover_slot_* functions of clover.h
// are defined there too). Not part of the C API.

#pragma once

#include <cstdint>
#include <vector>

struct clover_slot;

// the history's recurrent state (llama.cpp's partial sequence state: the part llama_memory_seq_rm cannot cut back
// beyond n_rs_seq), copied into `state`; and put back from a copy taken after n_past positions, cutting the attention
// entries from n_past on. false: llama.cpp refused (the history is then to be reset).
bool    clover_state_save(clover_slot * slot, std::vector<uint8_t> & state);
bool    clover_state_load(clover_slot * slot, const std::vector<uint8_t> & state, int32_t n_past);

// prefix cache (clover-cache.cpp)
bool    clover_cache_save(clover_slot * slot);                       // a checkpoint at n_past (false: none taken)
int32_t clover_cache_next_due(const clover_slot * slot);             // the next n_past a prefill checkpoints at, or -1
void    clover_cache_forget_after(clover_slot * slot, int32_t keep);   // drop checkpoints past the history
bool    clover_cache_rewind(clover_slot * slot);                     // back to the latest checkpoint
void    clover_cache_forget_all(clover_slot * slot);                 // no checkpoint, hint or rewind left
