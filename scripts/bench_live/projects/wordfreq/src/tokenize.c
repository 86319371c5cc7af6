#include <ctype.h>
#include <stdio.h>
#include "wordfreq.h"

static char buf[256];

const char *next_word(FILE *in) {
    int c;
    size_t n = 0;
    while ((c = fgetc(in)) != EOF && !isalpha(c)) {
    }
    if (c == EOF) return NULL;
    do {
        if (n + 1 < sizeof buf) buf[n++] = (char)c;
    } while ((c = fgetc(in)) != EOF && isalpha(c));
    buf[n] = '\0';
    return buf;
}
