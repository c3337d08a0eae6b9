// Auto mode and its cost table (clover-auto.cpp). Not part of the C API.

#pragma once

#include "clover.h"

struct clover_slot;
struct clover_run;

// auto mode (clover-auto.cpp)
bool clover_run_auto(clover_run & run);
bool clover_measure_costs(clover_slot * slot, clover_pass_costs & out);
