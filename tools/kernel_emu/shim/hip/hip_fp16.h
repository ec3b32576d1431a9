// CPU stand-in for hip/hip_fp16.h (emulator only).
#pragma once
#include "../cuda_fp16.h"
