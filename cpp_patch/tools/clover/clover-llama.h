// The clover model's C functions live with the model, in src/llama-clover.h.
#pragma once

#include "../../src/llama-clover.h"
