// The one entry point every op module uses to turn a returned cudaError_t into text.
#include <cuda_runtime.h>

extern "C" const char* qoq_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}
