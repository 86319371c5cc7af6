#!/bin/sh
# a deterministic corpus: mixed case, punctuation, about 2 MB
awk 'BEGIN {
  split("The quick brown fox jumps over the lazy dog and The Dog sleeps while the FOX runs", w, " ");
  n = length(w); s = 1;
  for (i = 0; i < 300000; i++) {
    s = (s * 1103515245 + 12345) % 2147483648;
    printf "%s%s", w[1 + int(s / 65536) % n], (i % 13 == 12) ? ".\n" : " ";
  }
}'
