// What a slot's passes cost (clover-costs.cpp): clover_slot_measure_costs. Not part of the C API.

#pragma once

#include "clover.h"

struct clover_slot;

// Runs of ar steps, of causal passes of 2 and a few rows, and block passes of 2 and a few rows on the slot's
// scratch sequence (the history is not touched). False with last_error set on failure.
bool clover_measure_costs(clover_slot * slot, clover_pass_costs & out);
