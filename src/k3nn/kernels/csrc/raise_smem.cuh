template <typename K>
cudaError_t raise_smem(K kern, int bytes, bool (&raised)[64]) {  // opt-in shared memory limit, once per device
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || !raised[dev]) {
    err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < 64) raised[dev] = true;
  }
  return cudaSuccess;
}
