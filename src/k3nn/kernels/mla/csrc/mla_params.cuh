struct MlaParams {
  const void* q_lat;
  const void* q_rope;
  const void* kv;
  const int* bt;
  const int* seq;
  const int* vis;  // nullptr: seq - Tq + 1 + t
  void* out;
  float* lse;
  float* o_part;    // [B, M, parts, 512] fp32 (parts > 1)
  float* lse_part;  // [B, M, parts] fp32 (parts > 1)
  long long s_qlb, s_qlt, s_qlh, s_qrb, s_qrt, s_qrh;
  long long s_kvb, s_kvr, s_btb, s_visb;
  long long s_ob, s_ot, s_oh, s_lb, s_lt, s_lh;
  float scale_log2;
  int B, Tq, H, M, page, splits;
  int tma_rows;  // wgmma kernel: rows per TMA box of the key tiles (16 or 64; 0: cp.async loads)
  int cluster;   // wgmma kernel: CTAs per cluster along the splits, merging their partials (1: none)
  int parts;     // partials per row that the combine merges: splits / cluster (1: stage 1 writes o and lse)
  struct alignas(64) { unsigned long long w[16]; } tmap;  // CUtensorMap of the pool [blocks, page, 576]
};
