// Checks mtpdraft::Accept against the sampling vector (tests/conformance/sampling_vector.json),
// no server needed:
//   mtpdraft-sampling [--vector PATH]
// One line per case, then "cpp: N passed, M failed"; exits 1 on any failure, 2 on a vector no
// runner may check (a wrong format, no cases, a case without drafts, q_ids, q_probs,
// target_probs, uniforms or expect).
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mtpdraft/sampling.h"

using nlohmann::json;

namespace {

const char* const kFormat = "mtpdraft-sampling/1";
const char* const kInputs[] = {"drafts", "q_ids", "q_probs", "target_probs", "uniforms"};

// Why no runner may check the vector, or "" if one may.
std::string VectorFault(const json& v) {
  if (!v.is_object()) return "the vector is not a JSON object";
  if (!v.contains("format") || v["format"] != kFormat) {
    return std::string("format is not \"") + kFormat + "\"";
  }
  if (!v.contains("cases") || !v["cases"].is_array() || v["cases"].empty()) {
    return "cases is missing or empty";
  }
  for (size_t i = 0; i < v["cases"].size(); ++i) {
    const json& c = v["cases"][i];
    const std::string name = c.is_object() ? c.value("name", "") : "";
    const std::string where = "case " + std::to_string(i) + " (" + name + "): ";
    for (const char* key : kInputs) {
      if (!c.is_object() || !c.contains(key) || !c[key].is_array() || c[key].empty()) {
        return where + key + " is missing or empty";
      }
    }
    const size_t rows = c["drafts"].size();
    const json e = c.value("expect", json());
    if (!e.is_object() || !e.contains("num_accepted") || !e.contains("next_tokens") ||
        !e["num_accepted"].is_array() || e["num_accepted"].size() != rows ||
        !e["next_tokens"].is_array() || e["next_tokens"].size() != rows) {
      return where + "expect is missing or not one value a row";
    }
  }
  return "";
}

// The numbers of nested arrays, row-major (a ragged array gives a size Accept refuses).
template <typename T>
void Flatten(const json& a, std::vector<T>& out) {
  if (!a.is_array()) {
    out.push_back(a.get<T>());
    return;
  }
  for (const json& x : a) Flatten(x, out);
}

// The first element's size along each of `depth` axes (0 where there is none).
std::vector<size_t> Shape(const json& a, size_t depth) {
  std::vector<size_t> shape;
  const json* x = &a;
  for (size_t d = 0; d < depth; ++d) {
    shape.push_back(x->is_array() ? x->size() : 0);
    x = x->is_array() && !x->empty() ? &(*x)[0] : x;
  }
  return shape;
}

std::string Show(const std::vector<int32_t>& values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? "," : "") + std::to_string(values[i]);
  return s + "]";
}

// Runs one case: true and what it gave, or false and why.
std::pair<bool, std::string> Check(const json& c) {
  std::vector<int32_t> drafts, q_ids, counts;
  std::vector<double> q_probs, target_probs, uniforms;
  Flatten(c["drafts"], drafts);
  Flatten(c["q_ids"], q_ids);
  Flatten(c["q_probs"], q_probs);
  Flatten(c["target_probs"], target_probs);
  Flatten(c["uniforms"], uniforms);
  if (c.contains("counts")) Flatten(c["counts"], counts);
  mtpdraft::AcceptArgs args;
  const std::vector<size_t> q_shape = Shape(c["q_ids"], 3);
  args.batch = q_shape[0], args.num_drafts = q_shape[1], args.support = q_shape[2];
  args.vocab = Shape(c["target_probs"], 3)[2];
  args.drafts = drafts, args.q_ids = q_ids, args.q_probs = q_probs;
  args.target_probs = target_probs, args.counts = counts, args.uniforms = uniforms;
  mtpdraft::Accepted got;
  try {
    got = mtpdraft::Accept(args);
  } catch (const std::exception& e) {
    return {false, e.what()};
  }
  const std::string shown = "kept " + Show(got.num_accepted) + ", next " + Show(got.next_tokens);
  const json& e = c["expect"];
  if (got.num_accepted == e["num_accepted"].get<std::vector<int32_t>>() &&
      got.next_tokens == e["next_tokens"].get<std::vector<int32_t>>()) {
    return {true, shown};
  }
  return {false, shown + "; expected kept " + e["num_accepted"].dump() + ", next " +
                     e["next_tokens"].dump()};
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = "tests/conformance/sampling_vector.json";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--vector" && i + 1 < argc) {
      path = argv[++i];
    } else {
      std::cerr << "usage: mtpdraft-sampling [--vector PATH]\n";
      return 2;
    }
  }
  json vector;
  try {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    vector = json::parse(in);
  } catch (const std::exception& e) {
    std::cerr << "cpp: bad vector: " << e.what() << "\n";
    return 2;
  }
  if (const std::string fault = VectorFault(vector); !fault.empty()) {
    std::cerr << "cpp: bad vector: " << fault << "\n";
    return 2;
  }
  int passed = 0, failed = 0;
  for (const json& c : vector["cases"]) {
    std::pair<bool, std::string> result;
    try {
      result = Check(c);
    } catch (const json::exception& e) {  // a value of the wrong type
      result = {false, e.what()};
    }
    result.first ? ++passed : ++failed;
    std::printf("%s %s: %s\n", result.first ? "ok  " : "FAIL", c.value("name", "").c_str(),
                result.second.c_str());
  }
  std::printf("cpp: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
