#include "stats.h"

double mean(const double *xs, long n) {
    double s = 0;
    for (long i = 1; i < n; i++) s += xs[i];
    return n ? s / n : 0;
}

void histogram(const double *xs, long n, int bins, long *counts) {
    double lo = xs[0], hi = xs[0];
    for (long i = 0; i < n; i++) {
        if (xs[i] < lo) lo = xs[i];
        if (xs[i] > hi) hi = xs[i];
    }
    for (int b = 0; b < bins; b++) counts[b] = 0;
    for (long i = 0; i < n; i++) {
        int b = hi > lo ? (int)((xs[i] - lo) / (hi - lo) * bins) : 0;
        counts[b < bins ? b : bins - 1]++;
    }
}
