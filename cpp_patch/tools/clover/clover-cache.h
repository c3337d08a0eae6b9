// The prefix cache's checkpoints along a slot's history (clover-cache.cpp; the clover_slot_* functions of clover.h
// are defined there too). Not part of the C API.

#pragma once

#include <cstdint>

struct clover_slot;

// prefix cache (clover-cache.cpp)
bool    clover_cache_save(clover_slot * slot);                       // a checkpoint at n_past (false: none taken)
int32_t clover_cache_next_due(const clover_slot * slot);             // the next n_past a prefill checkpoints at, or -1
void    clover_cache_forget_after(clover_slot * slot, int32_t keep);   // drop checkpoints past the history
bool    clover_cache_rewind(clover_slot * slot);                     // back to the latest checkpoint
void    clover_cache_forget_all(clover_slot * slot);                 // no checkpoint, hint or rewind left
