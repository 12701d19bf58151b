struct Args {
  const void* a;            // activations: x [tokens, K] (up, rows gathered by token) or h [rows, K] (down)
  long long stride_a;       // elements
  const uint8_t* w1;        // packed E2M1 [E, N, K/2] (w1 = gate, or the single matrix)
  const uint8_t* s1;        // E8M0 [E, N, K/32]
  const uint8_t* w3;        // up (GLU only)
  const uint8_t* s3;
  long long wse, wsn, sse, ssn;  // byte strides: packed (expert, row), scale (expert, row)
  void* out;                // up: h [nb*bm, N] in sorted-row order; down: y [pairs, N] at flat pair ids
  long long stride_o;
  const int* sorted;        // [nb*bm] flat pair ids, sentinel >= num_pairs
  const int* eid;           // [nb] expert of each block, -1 unused
  const int* num_rows;      // [1]
  int nb, bm, N, K, top_k, num_pairs;
  int a_by_token, act, cap, scale_vec;
  int pdl;                  // launch as a programmatic dependent of the previous kernel (down after up)
  float beta, linear_beta;
};
